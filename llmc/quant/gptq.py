"""GPTQ (Frantar et al., 2022): quantize a weight column by column and push each column's rounding error onto the
columns not yet quantized, weighted by the inverse Hessian of the layer's inputs, H = 2 X Xᵀ / n."""
import warnings
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from llmc.checkpoints.families import Family
from llmc.quant.layer import LayerWork
from llmc.quant.qtypes import (
    QuantArgs,
    QuantizedWeight,
    compute_qparams,
    dequantize_columns,
    observe_range,
    quantize_columns,
    weight_global_scale,
)
from llmc.quant.ranks import Ranks
from llmc.quant.stage import StageRole, StageRun, register_stage
from llmc.quant.weight_stage import WeightStage

DAMPENING_RETRIES = 5


class GPTQStage(WeightStage):
    type: Literal["gptq"]
    block_size: int = Field(128, gt=0)
    dampening_frac: float = Field(0.01, gt=0)

    @model_validator(mode="after")
    def _no_blocks(self) -> "GPTQStage":
        if self.weights.strategy == "block":
            raise ValueError("weights.strategy: GPTQ walks columns and cannot fix 2-D block scales; use type: rtn")
        return self

    @property
    def needs_calibration(self) -> bool:
        return True


def upper_cholesky_of_inverse(hessian: torch.Tensor, dampening_frac: float, name: str) -> torch.Tensor:
    """U with Uᵀ U = (H + λI)⁻¹, λ = dampening_frac x mean diagonal, raised tenfold while H + λI is not positive
    definite. If that never works, the identity: no error propagation, i.e. round-to-nearest."""
    eye = torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device)
    mean_diagonal = torch.diagonal(hessian).mean()
    if torch.isfinite(hessian).all():
        fraction = dampening_frac
        for _ in range(DAMPENING_RETRIES):
            lower, info = torch.linalg.cholesky_ex(hessian + fraction * mean_diagonal * eye)
            if info == 0:
                upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
                if info == 0 and torch.isfinite(upper).all():
                    return upper
            warnings.warn(f"{name}: Hessian not positive definite with dampening {fraction:g}; retrying with {fraction * 10:g}",
                          stacklevel=2)
            fraction *= 10
    warnings.warn(f"{name}: no usable Hessian; quantizing it by round-to-nearest", stacklevel=2)
    return eye


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    args: QuantArgs,
    block_size: int = 128,
    dampening_frac: float = 0.01,
    scale_dtype: torch.dtype | None = None,
    name: str = "weight",
) -> QuantizedWeight:
    scale_dtype = scale_dtype or weight.dtype
    work = weight.float().clone()
    hessian = hessian.float().clone()
    columns = work.shape[1]
    # inputs never seen in calibration get no error pushed onto them; their weights are kept (not zeroed), since
    # real inputs may still use them
    dead = torch.diagonal(hessian) == 0
    hessian[dead, dead] = 1
    grouped = args.grouped
    # the global scale (NVFP4), channel and tensor scales, and groups under static act-order, are fixed from the
    # original weight
    global_scale = weight_global_scale(work, args)
    fixed = None
    if not grouped or args.actorder == "static":
        fixed = compute_qparams(*observe_range(work, args, scale_dtype, global_scale), args, scale_dtype, global_scale)
    order = torch.argsort(torch.diagonal(hessian), descending=True) if args.actorder else torch.arange(columns, device=work.device)
    work, hessian = work[:, order], hessian[order][:, order]
    upper = upper_cholesky_of_inverse(hessian, dampening_frac, name)
    if grouped:
        block_size = max(args.group_size, block_size // args.group_size * args.group_size)  # whole groups per block

    codes = torch.empty_like(work, dtype=args.code_dtype)
    if fixed is not None:  # each column's own scale and zero point, in the permuted order
        expand = (lambda t: t[:, order // args.group_size]) if grouped else (lambda t: t.reshape(-1, 1).expand(work.shape))
        column_scales, column_zeros = expand(fixed[0]), expand(fixed[1])
    reached: list[tuple[torch.Tensor, torch.Tensor]] = []  # group parameters fixed when their first column comes
    for start in range(0, columns, block_size):
        end = min(start + block_size, columns)
        block = work[:, start:end]
        errors = torch.empty_like(block)
        for i in range(end - start):
            column = start + i
            if fixed is not None:
                scale, zero_point = column_scales[:, column : column + 1], column_zeros[:, column : column + 1]
            elif column % args.group_size == 0:
                group_range = observe_range(block[:, i : i + args.group_size], args, scale_dtype, global_scale)
                reached.append(compute_qparams(*group_range, args, scale_dtype, global_scale))
                scale, zero_point = reached[-1]
            original = block[:, i : i + 1]
            quantized = quantize_columns(original, scale, zero_point, args)
            codes[:, column] = quantized[:, 0]
            error = (original - dequantize_columns(quantized, scale, zero_point).float()) / upper[column, column]
            block[:, i:] -= error @ upper[column : column + 1, column:end]
            errors[:, i] = error[:, 0]
        work[:, end:] -= errors @ upper[start:end, end:]

    unpermuted = torch.empty_like(codes)
    unpermuted[:, order] = codes
    if fixed is not None:
        return QuantizedWeight(unpermuted, fixed[0], fixed[1], args, global_scale=global_scale)
    scale = torch.cat([s for s, _ in reached], dim=1)
    zero_point = torch.cat([z for _, z in reached], dim=1)
    g_idx = None
    if args.actorder == "group":
        g_idx = torch.empty(columns, dtype=torch.int32, device=work.device)
        g_idx[order] = torch.arange(columns, dtype=torch.int32, device=work.device) // args.group_size
    return QuantizedWeight(unpermuted, scale, zero_point, args, g_idx, global_scale=global_scale)


class GPTQRun(StageRun):
    config: GPTQStage

    def __init__(self, config: GPTQStage, scale_dtype: torch.dtype, family: Family):
        super().__init__(config, scale_dtype, family)
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.owner: dict[str, str] = {}  # Linear -> the Linear whose Hessian it shares (q/k/v, gate/up)
        self.last: tuple[str, torch.Tensor] | None = None

    def observed_modules(self, work: LayerWork) -> dict[str, nn.Module]:
        self._reset()
        return dict(work.linears)

    def record(self, name: str, inputs: torch.Tensor) -> None:
        # Linears fed the very same tensor object, one after the other, share an input and so one Hessian
        shares = self.last is not None and inputs is self.last[1]
        self.owner[name] = self.owner[self.last[0]] if shares else self.owner.get(name, name)
        self.last = (name, inputs)
        if self.owner[name] != name:
            return
        rows = inputs.reshape(-1, inputs.shape[-1]).float()
        self.sums[name] = self.sums.get(name, 0) + rows.T @ rows
        self.counts[name] = self.counts.get(name, 0) + rows.shape[0]

    def hessian(self, name: str) -> torch.Tensor:
        owner = self.owner[name]
        return 2 * self.sums[owner] / self.counts[owner]

    def input_groups(self, work: LayerWork) -> list[list[str]]:
        """Linears sharing a Hessian, to quantize as one stacked weight: GPTQ treats rows independently, so that is
        exact and walks the columns once. Not for per-tensor scales, which stacking would merge."""
        if self.config.weights.strategy == "tensor":
            return [[name] for name in work.linears]
        groups: dict[str, list[str]] = {}
        for name in work.linears:
            groups.setdefault(self.owner[name], []).append(name)
        return list(groups.values())

    def process(self, work: LayerWork) -> dict[str, QuantizedWeight]:
        """Across ranks: the Hessians summed, each input group solved by its owner rank, every result broadcast."""
        groups, ranks = self.input_groups(work), work.ranks
        for names in groups:
            owner = self.owner[names[0]]
            self.sums[owner] = ranks.sum(self.sums[owner])
            self.counts[owner] = int(ranks.sum_floats(self.counts[owner])[0])
        solved = {}
        for index, names in enumerate(groups):
            if ranks.owner(index) == ranks.rank:
                stacked = torch.cat([work.linears[name].weight.data for name in names])
                solved[index] = gptq_quantize(
                    stacked, self.hessian(names[0]), self.config.weights, block_size=self.config.block_size,
                    dampening_frac=self.config.dampening_frac, scale_dtype=self.scale_dtype, name="+".join(names),
                )
        results = {}
        for index, names in enumerate(groups):
            device = work.linears[names[0]].weight.device
            quantized = broadcast_quantized(ranks, solved.get(index), self.config.weights, ranks.owner(index), device)
            start = 0
            for name in names:
                linear = work.linears[name]
                part = quantized.rows(start, start + linear.out_features)
                linear.weight.data = part.dequantize().to(linear.weight.dtype)
                results[name] = part
                start += linear.out_features
        self._reset()
        return results


def broadcast_quantized(ranks: Ranks, weight: QuantizedWeight | None, args: QuantArgs, src: int, device: torch.device) -> QuantizedWeight:
    """The weight rank src quantized, on every rank."""
    if not ranks.distributed:
        return weight
    tensors = None
    if weight is not None:
        tensors = {"codes": weight.codes, "scale": weight.scale, "zero_point": weight.zero_point}
        tensors |= {"g_idx": weight.g_idx} if weight.g_idx is not None else {}
        tensors |= {"global_scale": weight.global_scale} if weight.global_scale is not None else {}
    received = ranks.broadcast_tensors(tensors, src, device)
    return QuantizedWeight(received["codes"], received["scale"], received["zero_point"], args, received.get("g_idx"),
                           global_scale=received.get("global_scale"))


register_stage(GPTQStage, GPTQRun, StageRole.WEIGHT)
