"""Quantized Linear forwards on torch's own kernels, shared by the runtime and the tests that check it against fake
quantization: int8 x int8 -> int32 GEMM through torch._int_mm, float8 E4M3 GEMM through torch._scaled_mm on CUDA.
On CPU int8 accumulates exactly in int32, FP8 in float32 (a float32 matmul of its codes), and the scales multiply
the result, as fake quantization does; on CUDA the FP8 scales go into _scaled_mm's epilogue. FP8 blocks accumulate
one 128-column slice at a time, each scaled by its activation group and weight block. The three steps (quantize the
inputs, multiply the codes, scale the sums) are `Kernels`, each replaceable by a faster one with the same bits."""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmc.quant.qtypes import QuantizedWeight, quantize_activation

CUDA_INT_MM_MIN_ROWS = 32  # torch._int_mm's cuBLAS int8 GEMM refuses 16 rows or fewer; small batches are padded


def int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, K] x [N, K] int8 -> [M, N] int32."""
    rows = a.shape[0]
    if a.is_cuda and rows < CUDA_INT_MM_MIN_ROWS:
        return torch._int_mm(F.pad(a, (0, 0, 0, CUDA_INT_MM_MIN_ROWS - rows)), b.t())[:rows]
    return torch._int_mm(a, b.t())


def _fp8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, K] x [N, K] float8 (on CPU the weight may come as its float32 codes) -> [M, N] float32, unscaled. On CPU a
    float32 matmul of the codes, which float32 holds exactly (as it does their products): torch's CPU _scaled_mm is a
    slow reference loop, ~100x a float32 matmul."""
    if not a.is_cuda:
        return a.float() @ b.float().t()
    unit = torch.ones((), device=a.device)
    return torch._scaled_mm(a, b.t(), scale_a=unit, scale_b=unit, out_dtype=torch.float32)


def _fp8_mm_scaled(a: torch.Tensor, act_scale: torch.Tensor, weight: QuantizedWeight, out_dtype: torch.dtype) -> torch.Tensor:
    """The scales in the GEMM's epilogue: one scalar each (tensor-wise), else one per row and per column (row-wise,
    which takes bfloat16 outputs only)."""
    weight_scale = weight.scale.float()
    if act_scale.numel() == 1 and weight_scale.numel() == 1:
        return torch._scaled_mm(a, weight.codes.t(), scale_a=act_scale.reshape(()), scale_b=weight_scale.reshape(()), out_dtype=out_dtype)
    scale_a = act_scale.float().reshape(-1, 1).expand(a.shape[0], 1).contiguous()
    scale_b = weight_scale.reshape(1, -1).expand(1, weight.codes.shape[0]).contiguous()
    return torch._scaled_mm(a, weight.codes.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


def codes_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, K] x [N, K] int8 or float8 codes -> [M, N] unscaled sums: int8's exact in int32, float8's in float32."""
    return int8_mm(a, b) if a.dtype == torch.int8 else _fp8_mm(a, b)


def _block_fp8_mm(codes: torch.Tensor, act_scale: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    rows, columns = weight.args.block_structure
    if weight.input_activations.strategy != "group" or weight.input_activations.group_size != columns:
        raise ValueError("FP8 block weights take per-token-group activations with one group per block column")
    row_scale = weight.scale.float().repeat_interleave(rows, dim=0)[: weight.codes.shape[0]]  # [out, in blocks]
    act_scale = act_scale.reshape(codes.shape[0], -1)  # [tokens, in blocks]
    out = torch.zeros(codes.shape[0], weight.codes.shape[0], device=codes.device)
    for block, start in enumerate(range(0, codes.shape[1], columns)):
        partial = _fp8_mm(codes[:, start : start + columns].contiguous(), weight.codes[:, start : start + columns].contiguous())
        out += partial * act_scale[:, block : block + 1] * row_scale[:, block]
    return out


def scale_sums(sums: torch.Tensor, act_scale: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    """sums [tokens, out] (int32, float32 or bfloat16) x act_scale per token (or one) x weight_scale per output (or
    one), in float32, + bias, in dtype."""
    out = sums.float() * act_scale.reshape(-1, 1) * weight_scale.float().reshape(1, -1)
    return (out if bias is None else out + bias).to(dtype)


@dataclass(frozen=True, slots=True)
class Kernels:
    """quantize_input: quantize_activation's contract; codes_matmul: codes_mm's; scale_sums: scale_sums';
    scaled_matmul (codes, act_scale, weight, bias, dtype): scale_sums of codes_matmul in one kernel, where there is one."""

    quantize_input: Callable = quantize_activation
    codes_matmul: Callable = codes_mm
    scale_sums: Callable = scale_sums
    scaled_matmul: Callable | None = None


def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    kernels: Kernels = Kernels(),
) -> torch.Tensor:
    """y = x Wᵀ (+ bias) with x quantized as weight.input_activations says (input_scale when static), by kernels
    (e.g. a fused quantizer, a weight packed at load)."""
    args = weight.input_activations
    codes, act_scale = kernels.quantize_input(x, args, input_scale)
    if weight.args.strategy == "block":
        out = _block_fp8_mm(codes, act_scale, weight)
    elif args.type == "float" and x.is_cuda:
        out = _fp8_mm_scaled(codes, act_scale, weight, x.dtype)
    else:
        if kernels.scaled_matmul is not None:
            out = kernels.scaled_matmul(codes, act_scale, weight, bias, x.dtype)
        else:
            out = kernels.scale_sums(kernels.codes_matmul(codes, weight.codes), act_scale, weight.scale, bias, x.dtype)
        return out.reshape(*x.shape[:-1], -1)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], -1).to(x.dtype)
