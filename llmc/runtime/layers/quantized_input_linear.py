"""W8A8 (int8) and FP8 Linears as the artifact describes them: inputs are quantized at run time, per token or with
the calibrated per-tensor scale, and multiplied in int8 or float8 by llmc.quant.quantized_mm: the arithmetic that
evaluation's fake quantization emulates, not dequantized weights."""
import torch
from torch import nn

from llmc.quant.qtypes import QuantizedWeight, quantize_activation
from llmc.quant.quantized_mm import Kernels, codes_mm, quantized_linear, scale_sums
from llmc.runtime.layers import cpu_int8_gemm, cpu_quantized_mm
from llmc.runtime.layers.linear_weight import LinearWeight
from llmc.runtime.layers.onednn_packed import packs_for_onednn


def _cuda_fp8_gemm_available(device: str) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(torch.device(device)) >= (8, 9)


class QuantizedInputLinear(nn.Module):
    def __init__(self, weight: LinearWeight, dtype: torch.dtype, device: str):
        super().__init__()
        quantized = weight.weight
        self.args, self.input_activations = quantized.args, quantized.input_activations
        self.kernels = Kernels()
        codes = quantized.codes.to(device)
        acts = self.input_activations
        if device == "cpu":
            codes = self._cpu_kernels(codes, dtype)
        elif device.startswith("cuda") and (acts.strategy == "token" or (acts.strategy == "tensor" and not acts.dynamic)):
            from llmc.runtime.layers.triton_act_quant import quantize_activation_triton

            self.kernels = Kernels(quantize_input=quantize_activation_triton)  # the same arithmetic in one kernel
        self.register_buffer("codes", codes)
        self.register_buffer("weight_scale", quantized.scale.to(device, torch.float32))
        self.register_buffer("zero_point", quantized.zero_point.to(device))
        self.register_buffer("input_scale", None if weight.input_scale is None else weight.input_scale.to(device, torch.float32))
        self.bias = None if weight.bias is None else nn.Parameter(weight.bias.to(device, dtype), requires_grad=False)

    def _cpu_kernels(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The CPU kernels these weights and inputs take (layers/cpu_quantized_mm.py, cpu_int8_gemm.py); returns the
        codes to keep."""
        packs_fp8 = self.args.type == "float" and self.args.strategy != "block" and packs_for_onednn(dtype, "cpu")
        quantize_input, scale = quantize_activation, scale_sums
        if cpu_quantized_mm.compiled_kernel() is not None:
            scale = cpu_quantized_mm.scale_sums_cpu
            if cpu_quantized_mm.kernel_quantizes(self.input_activations):
                quantize_input = cpu_quantized_mm.quantize_fp8_as_bfloat16 if packs_fp8 else cpu_quantized_mm.quantize_activation_cpu
        if packs_fp8:
            self.kernels = Kernels(quantize_input, cpu_quantized_mm.PackedFp8Matmul(codes), scale)
        elif self.args.type == "int" and cpu_int8_gemm.available():
            packed = cpu_int8_gemm.PackedInt8Matmul(codes, scale)
            self.kernels = Kernels(quantize_input, packed, scale, packed.scaled)
        else:
            self.kernels = Kernels(quantize_input, codes_mm, scale)
        if self.args.type == "int" or packs_fp8:
            return codes
        return codes.float()  # float32 holds E4M3 exactly: converted once, not every call

    @staticmethod
    def supports(weight: LinearWeight, dtype: torch.dtype, device: str) -> bool:
        quantized = weight.weight
        if not isinstance(quantized, QuantizedWeight) or quantized.input_activations is None or quantized.g_idx is not None:
            return False
        args, out_features, in_features = quantized.args, *quantized.codes.shape
        if not args.symmetric or args.num_bits != 8:
            return False
        if device == "cpu":
            return args.strategy in ("channel", "tensor") or (args.type == "float" and args.strategy == "block")
        if args.strategy not in ("channel", "tensor"):
            return False
        if args.type == "int":
            return in_features % 8 == 0 and out_features % 8 == 0
        return _cuda_fp8_gemm_available(device) and in_features % 16 == 0 and out_features % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = QuantizedWeight(self.codes, self.weight_scale, self.zero_point, self.args, None, self.input_activations)
        return quantized_linear(x, weight, self.input_scale, self.bias, self.kernels)
