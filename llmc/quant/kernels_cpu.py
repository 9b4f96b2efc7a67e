"""Quantized Linear forwards on torch's own CPU kernels, for the runtime: int8 x int8 -> int32 GEMM through
torch._int_mm and float8 E4M3 GEMM through torch._scaled_mm (fp32 accumulation), scales applied to the output.
FP8 blocks accumulate one 128-column slice at a time, each scaled by its activation group and weight block."""
import torch

from llmc.quant.qtypes import QuantizedWeight, quantize_activation

UNIT = torch.tensor(1.0)


def _fp8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(a, b.t(), scale_a=UNIT, scale_b=UNIT, out_dtype=torch.float32)


def _block_fp8_mm(codes: torch.Tensor, act_scale: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    rows, columns = weight.args.block_structure
    if weight.input_activations.strategy != "group" or weight.input_activations.group_size != columns:
        raise ValueError("FP8 block weights take per-token-group activations with one group per block column")
    row_scale = weight.scale.float().repeat_interleave(rows, dim=0)[: weight.codes.shape[0]]  # [out, in blocks]
    act_scale = act_scale.reshape(codes.shape[0], -1)  # [tokens, in blocks]
    out = torch.zeros(codes.shape[0], weight.codes.shape[0])
    for block, start in enumerate(range(0, codes.shape[1], columns)):
        partial = _fp8_mm(codes[:, start : start + columns].contiguous(), weight.codes[:, start : start + columns].contiguous())
        out += partial * act_scale[:, block : block + 1] * row_scale[:, block]
    return out


def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x Wᵀ (+ bias) with x quantized as weight.input_activations says (input_scale when static)."""
    args = weight.input_activations
    codes, act_scale = quantize_activation(x, args, input_scale)
    if weight.args.strategy == "block":
        out = _block_fp8_mm(codes, act_scale, weight)
    else:
        accumulated = torch._int_mm(codes, weight.codes.t()).float() if args.type == "int" else _fp8_mm(codes, weight.codes)
        out = accumulated * act_scale.reshape(-1, 1) * weight.scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], -1).to(x.dtype)
