"""Linear layers built once at load from an artifact's weights. Each kernel says which weights, dtypes and devices it
`supports`; `build_linear` takes the first that does, so W8A8, FP8 and GPU kernels plug in by joining KERNELS."""
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from llmc.quant.qtypes import QuantizedWeight, fake_quantize_activation
from llmc.runtime.layers import cpu_int8_gemv, cpu_nibble_gemv
from llmc.runtime.layers.cpu_fp4_gemm import Fp4CpuLinear
from llmc.runtime.layers.cpu_nibble_gemv import NibbleMatmul
from llmc.runtime.layers.dense_copy import DenseCopy
from llmc.runtime.layers.int4_amx import Int4Matmul, compile_amx
from llmc.runtime.layers.linear_weight import LinearWeight, merge
from llmc.runtime.layers.onednn_packed import PackedWeight, packs_for_onednn
from llmc.runtime.layers.quantized_input_linear import QuantizedInputLinear
from llmc.runtime.layers.w4a16_triton_linear import W4A16TritonLinear


class DenseLinear(nn.Module):
    """Plain weights, or quantized ones dequantized once at load with llmc's own arithmetic (the fallback)."""

    def __init__(self, weight: LinearWeight, dtype: torch.dtype, device: str):
        super().__init__()
        dense = weight.weight.dequantize() if isinstance(weight.weight, QuantizedWeight) else weight.weight
        self.weight = nn.Parameter(dense.to(device, dtype), requires_grad=False)
        self.bias = None if weight.bias is None else nn.Parameter(weight.bias.to(device, dtype), requires_grad=False)
        self.packed = PackedWeight(self.weight.data, self.bias) if packs_for_onednn(dtype, device) else None

    @staticmethod
    def supports(weight: LinearWeight, dtype: torch.dtype, device: str) -> bool:
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dtype == torch.bfloat16:
            return self.packed(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        return F.linear(x, self.weight, self.bias)


def torch_int4_matmul(codes: torch.Tensor, scale: torch.Tensor, group_size: int) -> Int4Matmul:
    """Symmetric int4 codes [out, in] (-8..7) and their scales [out, groups] in torch's CPU int4 layout."""
    scale = scale.t()  # [in / group_size, out]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32) + 8, 1)
    return Int4Matmul(packed, torch.stack([scale, torch.zeros_like(scale)], dim=-1).contiguous(), group_size)


def bfloat16_cpu_weight_only(weight: LinearWeight, dtype: torch.dtype, device: str, num_bits: int, strategy: str) -> bool:
    """Whether weight is symmetric int `num_bits` by `strategy`, without act-order or quantized inputs, served in
    bfloat16 on CPU: what torch's int4 and int8 CPU kernels take (their float32 paths are slower than dense matmuls)."""
    quantized = weight.weight
    return (
        device == "cpu"
        and dtype == torch.bfloat16
        and isinstance(quantized, QuantizedWeight)
        and quantized.g_idx is None
        and quantized.input_activations is None
        and quantized.args.type == "int"
        and quantized.args.num_bits == num_bits
        and quantized.args.symmetric
        and quantized.args.strategy == strategy
    )


class Int4CpuLinear(DenseCopy, nn.Module):
    """Symmetric int4 groups on the CPU. Steps of a few rows in bfloat16 run on llmc's nibble kernel
    (cpu_nibble_gemv.py: AVX-512 BF16) where the CPU has it, else on torch's own int4 kernel, the codes repacked into
    its layout once, at load. Either way each weight is its code times its scale in the compute dtype (torch's zero
    term is 0), so only the summation order differs from `dequantize`'s dense matmul. The kernels multiply row by
    row, their time growing with the rows: steps of more than `max_eager_rows` rows go on the compiled AMX matmul
    (int4_amx) on a CPU with AMX (`use_amx`), else on a bfloat16 copy of the weights (`use_dense_copy`,
    dense_copy.py)."""

    GROUP_SIZES = (32, 64, 128, 256)

    def __init__(self, weight: LinearWeight, dtype: torch.dtype, device: str):
        super().__init__()
        quantized = weight.weight
        self.out_features, self.in_features = quantized.codes.shape
        self.group_size, self.dtype = quantized.args.group_size, dtype
        scale = quantized.scale.to(dtype)
        self.matmul: NibbleMatmul | Int4Matmul
        if cpu_nibble_gemv.serves(dtype, self.in_features, self.group_size):
            self.matmul = NibbleMatmul.int4(quantized.codes, scale, self.group_size)
        else:
            self.matmul = torch_int4_matmul(quantized.codes, scale, self.group_size)
        self.bias = None if weight.bias is None else nn.Parameter(weight.bias.to(dtype), requires_grad=False)
        self.amx: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.no_dense_copy()

    @classmethod
    def supports(cls, weight: LinearWeight, dtype: torch.dtype, device: str) -> bool:
        quantized = weight.weight
        return (
            bfloat16_cpu_weight_only(weight, dtype, device, num_bits=4, strategy="group")
            and quantized.args.group_size in cls.GROUP_SIZES
            and quantized.codes.shape[0] % 8 == 0
        )

    def use_amx(self, max_eager_rows: int) -> bool:
        """Compile the AMX matmul now; whether it serves (it does not where it disagrees with the eager kernel)."""
        matmul = self.matmul
        if isinstance(matmul, NibbleMatmul):  # the AMX template takes torch's layout
            matmul = torch_int4_matmul(matmul.int4_codes(), matmul.scales.to(self.dtype), self.group_size)
        self.amx = compile_amx(matmul, self.dtype)
        self.max_eager_rows = max_eager_rows
        return self.amx is not None

    def use_dense_copy(self, weight: QuantizedWeight, max_eager_rows: int) -> None:
        """Keep weight (this layer's, as built) dequantized beside the codes for steps of more than max_eager_rows rows:
        each code times its scale in the compute dtype, the product the kernel multiplies by, rounded to that dtype."""
        self.keep_dense_copy(replace(weight, scale=weight.scale.to(self.dtype).float()).dequantize().to(self.dtype), max_eager_rows)

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        rows = len(flat)
        if (dense := self.dense_product(flat)) is not None:
            return dense
        if rows <= self.max_eager_rows or self.amx is None:
            return self.matmul(flat)
        if rows == 1:
            return self.amx(torch.cat([flat, flat]))[:1]
        return self.amx(flat)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._product(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


class Int8CpuLinear(nn.Module):
    """Symmetric per-channel int8 weights (W8A16, an int8 LM head) in bfloat16, half the bytes of bfloat16 weights:
    on llmc's int8 GEMV where the CPU has AVX-512 BF16 (cpu_int8_gemv.py: SmolLM2's 49,152 x 576 head at one row in
    1.05 ms against 2.45 for torch's kernel, at 16 rows 6.1 against 21.0), else on torch's own int8 kernel, at one
    row about twice as fast as a dense matmul. Chosen for bfloat16 inputs only, like Int4CpuLinear."""

    def __init__(self, weight: LinearWeight, dtype: torch.dtype, device: str):
        super().__init__()
        quantized = weight.weight
        self.out_features, self.in_features = quantized.codes.shape
        self.register_buffer("codes", quantized.codes.contiguous())
        self.register_buffer("scales", quantized.scale.reshape(-1).to(dtype))
        self.gemv = dtype == torch.bfloat16 and self.in_features % cpu_int8_gemv.CHUNK == 0 and cpu_int8_gemv.available()
        # not a buffer: a module's .to(dtype) (drafts are cast so) must leave the GEMV's scales in float32
        self.float_scales = self.scales.float() if self.gemv else None
        self.bias = None if weight.bias is None else nn.Parameter(weight.bias.to(dtype), requires_grad=False)

    @classmethod
    def supports(cls, weight: LinearWeight, dtype: torch.dtype, device: str) -> bool:
        return bfloat16_cpu_weight_only(weight, dtype, device, num_bits=8, strategy="channel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.gemv:
            out = cpu_int8_gemv.int8_gemv(flat, self.codes, self.float_scales)
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scales)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


class EmulatedInputLinear(nn.Module):
    """Quantized inputs llmc has no quantized-input GEMM for (W4A8, W4AFP8, NVFP4, MXFP4, MXFP8): each input is
    quantized and dequantized as the artifact says, then multiplied by the weight-only kernel of the same weights.
    The products are the quantized GEMM's up to summation order: what a W4A8 kernel computes exactly, at the speed
    of the weight-only one."""

    def __init__(self, weight: LinearWeight, dtype: torch.dtype, device: str):
        super().__init__()
        self.input_activations = weight.weight.input_activations
        self.register_buffer("input_scale", None if weight.input_scale is None else weight.input_scale.to(device, torch.float32))
        weight_only = replace(weight, weight=replace(weight.weight, input_activations=None), input_scale=None)
        self.weights = build_linear([weight_only], dtype, device)

    @staticmethod
    def supports(weight: LinearWeight, dtype: torch.dtype, device: str) -> bool:
        return isinstance(weight.weight, QuantizedWeight) and weight.weight.input_activations is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weights(fake_quantize_activation(x, self.input_activations, self.input_scale))


# by priority; DenseLinear takes anything
KERNELS: list[type[nn.Module]] = [
    QuantizedInputLinear, EmulatedInputLinear, W4A16TritonLinear, Int4CpuLinear, Int8CpuLinear, Fp4CpuLinear, DenseLinear,
]
# kernels that can keep a dense copy of their weights for steps of many rows (use_dense_copy)
DENSE_COPY_KERNELS = (Int4CpuLinear, Fp4CpuLinear)


def build_linear(parts: list[LinearWeight], dtype: torch.dtype, device: str, dense: bool = False) -> nn.Module:
    """dense: weight-only quantized layers dequantized once, onto dense matmuls (those with quantized activations keep
    their kernels: dense, their inputs would go unquantized)."""
    weight = merge(parts)
    weight_only = not isinstance(weight.weight, QuantizedWeight) or weight.weight.input_activations is None
    kernels = [DenseLinear] if dense and weight_only else KERNELS
    kernel = next(kernel for kernel in kernels if kernel.supports(weight, dtype, device))
    return kernel(weight, dtype, device).to(device)
