"""SmoothQuant (Xiao et al., 2022). Per scaling pair, s_j = max|x_j|^alpha / max|w_j|^(1-alpha) over the
calibration inputs x and the balance Linears' input columns w; the smooth side is divided by s and the balance
columns multiplied by s (AWQ's fold), so the full-precision model is unchanged while activation outliers move into
the weights, where 8-bit per-channel scales absorb them."""
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from llmc.checkpoints.families import Family
from llmc.core.schema import StrictModel
from llmc.quant.awq import fold_scales, scalable_pairs
from llmc.quant.layer import LayerWork
from llmc.quant.qtypes import QuantizedWeight
from llmc.quant.stage import StageRole, StageRun, register_stage

MIN_SCALE = 1e-5


class SmoothQuantStage(StrictModel):
    """Moves activation outliers into the weights: per scaling pair, s_j = max|x_j|^alpha / max|w_j|^(1-alpha)
    divides the preceding norm (or Linear) and multiplies the balance Linears' input columns, so the model in full
    precision is unchanged and a later W8A8 stage quantizes smoother activations; quantizes nothing itself."""

    type: Literal["smoothquant"]
    alpha: float = Field(0.5, ge=0, le=1)  # smoothing strength: 0 leaves activations, 1 moves all range to weights
    targets: list[str] = ["Linear"]  # pairs whose every balance Linear matches are smoothed
    ignore: list[str] = []
    needs_calibration: ClassVar[bool] = True


def smoothing_scales(input_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    weight_max = torch.cat(weights).abs().amax(dim=0)
    scales = input_max.clamp(min=MIN_SCALE).pow(alpha) / weight_max.clamp(min=MIN_SCALE).pow(1 - alpha)
    return scales.clamp(min=MIN_SCALE)


class SmoothQuantRun(StageRun):
    config: SmoothQuantStage

    def __init__(self, config: SmoothQuantStage, scale_dtype: torch.dtype, family: Family):
        super().__init__(config, scale_dtype, family)
        self.input_max: dict[str, torch.Tensor] = {}

    def observed_modules(self, work: LayerWork) -> dict[str, nn.Module]:
        self.input_max = {}
        return {pair.balance[0]: work.layer.get_submodule(pair.balance[0]) for pair in scalable_pairs(self.family, work)}

    def record(self, name: str, inputs: torch.Tensor) -> None:
        batch_max = inputs.abs().reshape(-1, inputs.shape[-1]).amax(dim=0)
        self.input_max[name] = torch.maximum(self.input_max[name], batch_max) if name in self.input_max else batch_max

    @torch.no_grad()
    def process(self, work: LayerWork) -> dict[str, QuantizedWeight]:
        for pair in scalable_pairs(self.family, work):
            weights = [work.layer.get_submodule(name).weight.data for name in pair.balance]
            scales = smoothing_scales(work.ranks.max(self.input_max.pop(pair.balance[0])), weights, self.config.alpha)
            fold_scales(work.layer, pair, scales, self.family.norm_offset)
        self.input_max = {}
        return {}


register_stage(SmoothQuantStage, SmoothQuantRun, StageRole.TRANSFORM)
