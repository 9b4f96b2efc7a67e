"""4-bit group weights on the Triton W4A16 kernel: int4 (symmetric, or asymmetric with zero points: GPTQ, AWQ) and
float4 E2M1 (NVFP4, MXFP4, whose scales stay float32: NVFP4's float8 scale over its global scale is no bfloat16).
Chosen on CUDA; the kernel module (and Triton) is imported only when one is built."""
import torch
from torch import nn

from llmc.artifact.pack import e2m1_nibbles
from llmc.quant.qtypes import QuantizedWeight
from llmc.runtime.layers.linear_weight import LinearWeight


class W4A16TritonLinear(nn.Module):
    def __init__(self, weight: LinearWeight, dtype: torch.dtype, device: str):
        super().__init__()
        from llmc.runtime.layers.triton_w4a16 import repack_nibbles, w4a16_matmul

        self.matmul = w4a16_matmul
        quantized = weight.weight
        self.group_size, self.float4 = quantized.args.group_size, quantized.args.is_fp4
        self.out_features = quantized.codes.shape[0]
        codes = quantized.codes.to(device)
        self.register_buffer("packed", repack_nibbles(e2m1_nibbles(codes) if self.float4 else codes.to(torch.int32) + 8))
        scale_dtype = torch.float32 if self.float4 else dtype
        self.register_buffer("scales", quantized.scale.to(device, scale_dtype).reshape(self.out_features, -1).t().contiguous())
        zeros = None if quantized.args.symmetric else quantized.zero_point.to(device, dtype).t().contiguous()
        self.register_buffer("zeros", zeros)
        self.bias = None if weight.bias is None else nn.Parameter(weight.bias.to(device, dtype), requires_grad=False)

    @staticmethod
    def supports(weight: LinearWeight, dtype: torch.dtype, device: str) -> bool:
        quantized = weight.weight
        return (
            device.startswith("cuda")
            and dtype in (torch.float16, torch.bfloat16)
            and isinstance(quantized, QuantizedWeight)
            and quantized.input_activations is None
            and quantized.g_idx is None
            and quantized.args.num_bits == 4
            and (quantized.args.type == "int" and quantized.args.strategy == "group" or quantized.args.is_fp4)
            and quantized.args.group_size % 16 == 0  # the kernel's K tiles lie within one group
            and quantized.codes.shape[1] % quantized.args.group_size == 0
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = self.matmul(flat, self.packed, self.scales, self.zeros, self.group_size, float4=self.float4)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias
