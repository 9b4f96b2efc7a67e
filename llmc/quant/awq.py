"""AWQ (Lin et al., 2023). Per scaling pair, the balance Linears' input channels are multiplied by s and the
preceding norm or Linear's outputs divided by s, so the full-precision model computes the same function while
salient channels get more of the later quantization's resolution. s = mean|x|^α / mean|w|^(1-α), with α chosen
on a grid for the smallest error of the block's output once the balance weights are quantized. An optional
clip search then shrinks each group's range to the value with the smallest output error."""
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from llmc.checkpoints.families import Family, ScalingPair
from llmc.core.schema import StrictModel
from llmc.quant.layer import LayerWork
from llmc.quant.qtypes import QuantArgs, QuantizedWeight, fake_quantize
from llmc.quant.ranks import Ranks
from llmc.quant.stage import StageRole, StageRun, register_stage

CLIP_TOKENS = 512  # evenly spaced calibration tokens for the clip search, as AutoAWQ samples


class AWQStage(StrictModel):
    """Scales each (norm or Linear) -> Linears pair so that a later stage's quantization loses less; quantizes
    nothing itself."""

    type: Literal["awq"]
    targets: list[str] = ["Linear"]  # pairs whose every balance Linear matches are scaled
    ignore: list[str] = []
    n_grid: int = Field(20, gt=1)
    duo_scaling: bool = True
    clip_search: bool = False
    max_shrink: float = Field(0.5, gt=0, lt=1)  # the clip search tries ranges down to (1 - max_shrink) x max
    needs_calibration: ClassVar[bool] = True


def group_width(args: QuantArgs, columns: int) -> int:
    return args.group_size if args.grouped else columns


def weight_magnitude(weights: list[torch.Tensor], width: int) -> torch.Tensor:
    """Mean over output rows of |w| relative to its group's largest |w|: [in]."""
    stacked = torch.cat(weights).abs()
    grouped = stacked.reshape(stacked.shape[0], -1, width)
    return (grouped / (grouped.amax(dim=-1, keepdim=True) + 1e-6)).reshape(stacked.shape).mean(dim=0)


def search_clip(weight: torch.Tensor, inputs: torch.Tensor, args: QuantArgs, n_grid: int, max_shrink: float) -> torch.Tensor:
    """The weight with each (row, group) clipped to the range of smallest quantized output error on `inputs`."""
    rows, columns = weight.shape
    width = group_width(args, columns)
    grouped = weight.reshape(rows, -1, width)
    samples = inputs.reshape(inputs.shape[0], -1, width)
    reference = torch.einsum("ngw,ogw->nog", samples, grouped)
    original_max = grouped.abs().amax(dim=-1, keepdim=True)
    best_max, best_error = original_max.clone(), torch.full_like(original_max, float("inf"))
    for step in range(max(1, int(max_shrink * n_grid))):
        limit = original_max * (1 - step / n_grid)
        candidate = fake_quantize(grouped.clamp(-limit, limit).reshape(rows, columns), args).reshape(grouped.shape)
        error = (torch.einsum("ngw,ogw->nog", samples, candidate) - reference).pow(2).mean(dim=0).unsqueeze(-1)
        better = error < best_error
        best_error, best_max = torch.where(better, error, best_error), torch.where(better, limit, best_max)
    return grouped.clamp(-best_max, best_max).reshape(rows, columns)


def scalable_pairs(family: Family, work: LayerWork) -> list[ScalingPair]:
    """The family's pairs whose balance Linears the stage targets and a later stage quantizes, and whose smooth
    side has as many outputs as the balance side has inputs (v -> o only without grouped KV heads)."""
    chosen = []
    for pair in family.scaling_pairs:
        names = [f"{work.prefix}.{name}" for name in pair.balance]
        if not all(name in work.linears and name in work.plan for name in names):
            continue
        smooth = work.layer.get_submodule(pair.smooth)
        width = smooth.out_features if isinstance(smooth, nn.Linear) else smooth.weight.shape[0]
        if width == work.linears[names[0]].in_features:
            chosen.append(pair)
    return chosen


class AWQRun(StageRun):
    config: AWQStage

    def __init__(self, config: AWQStage, scale_dtype: torch.dtype, family: Family):
        super().__init__(config, scale_dtype, family)
        self.inputs: dict[str, list[torch.Tensor]] = {}

    def pairs(self, work: LayerWork) -> list[ScalingPair]:
        return scalable_pairs(self.family, work)

    def observed_modules(self, work: LayerWork) -> dict[str, nn.Module]:
        self.inputs = {}
        return {pair.block: work.layer.get_submodule(pair.block) for pair in self.pairs(work)}

    def record(self, name: str, inputs: torch.Tensor) -> None:
        self.inputs.setdefault(name, []).append(inputs)

    def process(self, work: LayerWork) -> dict[str, QuantizedWeight]:
        clip_inputs = []
        for pair in self.pairs(work):
            block_inputs = torch.cat(self.inputs.pop(pair.block))
            scales = self.search_scales(work, pair, block_inputs)
            fold_scales(work.layer, pair, scales, self.family.norm_offset)
            clip_inputs.append((pair, clip_tokens(work.ranks, block_inputs.reshape(-1, block_inputs.shape[-1])) / scales))
        if self.config.clip_search:
            for pair, inputs in clip_inputs:
                for name in pair.balance:
                    if name not in self.family.no_clip:
                        linear = work.layer.get_submodule(name)
                        args = work.plan[f"{work.prefix}.{name}"]
                        linear.weight.data = search_clip(linear.weight.data, inputs, args, self.config.n_grid, self.config.max_shrink)
        self.inputs = {}
        return {}

    @torch.no_grad()
    def search_scales(self, work: LayerWork, pair: ScalingPair, block_inputs: torch.Tensor) -> torch.Tensor:
        block = work.layer.get_submodule(pair.block)
        balance = {name: work.layer.get_submodule(name) for name in pair.balance}
        formats = {name: work.plan[f"{work.prefix}.{name}"] for name in pair.balance}
        originals = {name: linear.weight.data.clone() for name, linear in balance.items()}

        def run() -> torch.Tensor:
            return work.runner(block, block_inputs, positional=pair.block_is_attention)

        reference = run()
        rows = block_inputs.reshape(-1, block_inputs.shape[-1])
        input_magnitude = (work.ranks.sum(absolute_sum(rows)) / work.ranks.sum_floats(rows.shape[0])[0]).float()
        first = formats[pair.balance[0]]
        weight_mag = weight_magnitude(list(originals.values()), group_width(first, input_magnitude.numel()))
        best_error, best_scales = float("inf"), torch.ones_like(input_magnitude)
        for step in range(self.config.n_grid):
            alpha = step / self.config.n_grid
            scales = input_magnitude.pow(alpha)
            if self.config.duo_scaling:
                scales = scales / (weight_mag.pow(1 - alpha) + 1e-4)
            scales = scales.clamp(min=1e-4)
            scales = scales / (scales.max() * scales.min()).sqrt()
            for name, linear in balance.items():
                linear.weight.data = fake_quantize(originals[name] * scales, formats[name]) / scales
            error_sum, count = work.ranks.sum_floats(float((run() - reference).pow(2).sum()), reference.numel())
            error = error_sum / count
            if error < best_error:
                best_error, best_scales = error, scales
        for name, linear in balance.items():
            linear.weight.data = originals[name]
        return best_scales


def absolute_sum(rows: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """sum |x| over the rows, accumulated in float64 a chunk at a time: the same float32 mean however the rows are
    split among ranks, so ranks choose the same scales."""
    return sum(part.abs().double().sum(dim=0) for part in rows.split(chunk))


def clip_tokens(ranks: Ranks, tokens: torch.Tensor) -> torch.Tensor:
    """CLIP_TOKENS evenly spaced among every rank's tokens (in rank order, the calibration set's), on every rank."""
    offset, total = ranks.row_offset(tokens.shape[0])
    picked = torch.linspace(0, total - 1, min(CLIP_TOKENS, total), device=tokens.device).long()
    mine = picked[(picked >= offset) & (picked < offset + tokens.shape[0])] - offset
    return ranks.gather_rows(tokens[mine])


def fold_scales(layer: nn.Module, pair: ScalingPair, scales: torch.Tensor, norm_offset: float = 0.0) -> None:
    """Divide the smooth side's outputs by s and multiply the balance (and also-scaled) Linears' inputs by s. A norm scaling by
    (norm_offset + weight) gets the weight that makes its gain (norm_offset + weight) / s."""
    smooth = layer.get_submodule(pair.smooth)
    if isinstance(smooth, nn.Linear):
        smooth.weight.data /= scales.unsqueeze(1)
        if smooth.bias is not None:
            smooth.bias.data /= scales
    else:
        smooth.weight.data = (smooth.weight.data + norm_offset) / scales - norm_offset
    for name in pair.balance + pair.also_scaled:
        layer.get_submodule(name).weight.data *= scales


register_stage(AWQStage, AWQRun, StageRole.TRANSFORM)
