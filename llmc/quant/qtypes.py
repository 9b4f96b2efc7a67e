"""One description of a quantization format and the arithmetic every algorithm, the packer and the runtime share.

The conventions are compressed-tensors': signed integer codes in [-2^(b-1), 2^(b-1) - 1], symmetric scale
absmax / ((qmax - qmin) / 2), asymmetric zero points in the signed code range, W = (q - zero_point) * scale.
"""
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, model_validator

Strategy = Literal["tensor", "channel", "group"]
ActOrder = Literal["static", "group"]


class QuantArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_bits: Literal[4, 8] = 4
    type: Literal["int"] = "int"
    symmetric: bool = True
    strategy: Strategy = "group"
    group_size: int | None = 128
    # columns quantized in decreasing Hessian-diagonal order (GPTQ); "group" also regroups them, needing g_idx
    actorder: ActOrder | None = None

    @model_validator(mode="after")
    def _group_size_matches_strategy(self) -> "QuantArgs":
        if self.strategy == "group" and (self.group_size is None or self.group_size <= 0):
            raise ValueError("strategy 'group' needs a positive group_size")
        if self.actorder == "group" and self.strategy != "group":
            raise ValueError("actorder 'group' needs strategy 'group'")
        if self.strategy != "group" and self.group_size is not None:
            object.__setattr__(self, "group_size", None)
        return self

    @property
    def qmin(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    def describe(self) -> str:
        kind = "sym" if self.symmetric else "asym"
        granularity = f"g{self.group_size}" if self.strategy == "group" else self.strategy
        order = f" actorder={self.actorder}" if self.actorder else ""
        return f"int{self.num_bits} {kind} {granularity}{order}"


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # int8, same shape as the weight
    scale: torch.Tensor  # [out, 1] channel, [out, in / group_size] group, [1] tensor
    zero_point: torch.Tensor  # int8, shaped like scale; all zero when symmetric
    args: QuantArgs
    g_idx: torch.Tensor | None = None  # int32 [in]: the group of each input column, when actorder is "group"

    def rows(self, start: int, end: int) -> "QuantizedWeight":
        """Output rows start:end, e.g. one Linear's share of weights quantized stacked (not for per-tensor scales)."""
        g_idx = None if self.g_idx is None else self.g_idx.clone()  # own storage: safetensors refuses shared tensors
        return QuantizedWeight(
            self.codes[start:end].clone(), self.scale[start:end].clone(), self.zero_point[start:end].clone(), self.args, g_idx
        )

    def dequantize(self) -> torch.Tensor:
        if self.g_idx is not None:
            return dequantize_columns(self.codes, self.scale[:, self.g_idx], self.zero_point[:, self.g_idx])
        return dequantize(self.codes, self.scale, self.zero_point, self.args)


def _grouped(x: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """View a [out, in] weight so that reductions over the last dim follow the strategy."""
    if args.strategy == "tensor":
        return x.reshape(1, 1, -1)
    if args.strategy == "channel":
        return x.reshape(x.shape[0], 1, x.shape[1])
    if x.shape[1] % args.group_size:
        raise ValueError(f"group_size {args.group_size} does not divide {x.shape[1]} input columns")
    return x.reshape(x.shape[0], x.shape[1] // args.group_size, args.group_size)


def observe_minmax(weight: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    grouped = _grouped(weight, args)
    return grouped.amin(dim=-1), grouped.amax(dim=-1)


def compute_qparams(
    min_vals: torch.Tensor, max_vals: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    min_vals = min_vals.float().clamp(max=0)
    max_vals = max_vals.float().clamp(min=0)
    if args.symmetric:
        scale = torch.maximum(-min_vals, max_vals) / ((args.qmax - args.qmin) / 2)
    else:
        scale = (max_vals - min_vals) / (args.qmax - args.qmin)
    # the stored scale is what the consumer multiplies by, so quantize with exactly that value
    scale = scale.to(scale_dtype)
    scale = torch.where(scale == 0, torch.finfo(scale_dtype).eps, scale)
    if args.symmetric:
        zero_point = torch.zeros_like(scale, dtype=torch.int8)
    else:
        zero_point = torch.round(args.qmin - min_vals / scale.float()).clamp(args.qmin, args.qmax).to(torch.int8)
    if args.strategy == "tensor":
        return scale.reshape(1), zero_point.reshape(1)
    return scale, zero_point


def quantize_columns(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """Elementwise rounding onto the grid; scale and zero_point broadcast against x (e.g. [out, 1] per column)."""
    codes = torch.round(x.float() / scale.float() + zero_point)
    return codes.clamp(args.qmin, args.qmax).to(torch.int8)


def dequantize_columns(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    return (codes.to(scale.dtype) - zero_point.to(scale.dtype)) * scale


def quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    grouped = _grouped(x, args)
    shape = (*grouped.shape[:2], 1)
    return quantize_columns(grouped, scale.reshape(shape), zero_point.reshape(shape), args).reshape(x.shape)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    grouped = _grouped(codes, args)
    shape = (*grouped.shape[:2], 1)
    return dequantize_columns(grouped, scale.reshape(shape), zero_point.reshape(shape)).reshape(codes.shape)


def quantize_weight(weight: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype | None = None) -> QuantizedWeight:
    """Round-to-nearest with min/max ranges: the base every algorithm starts from."""
    scale, zero_point = compute_qparams(*observe_minmax(weight, args), args, scale_dtype or weight.dtype)
    return QuantizedWeight(quantize(weight, scale, zero_point, args), scale, zero_point, args)


def fake_quantize(weight: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    return quantize_weight(weight, args).dequantize().to(weight.dtype)
