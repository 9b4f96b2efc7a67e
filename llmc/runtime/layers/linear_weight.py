"""A Linear's tensors as the loader reads them, and the stacking of projections that share an input."""
from dataclasses import dataclass, replace

import torch

from llmc.quant.qtypes import QuantizedWeight, static_input_name


@dataclass(slots=True)
class LinearWeight:
    weight: torch.Tensor | QuantizedWeight  # [out, in]
    bias: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None  # static per-tensor activation scale, when inputs are quantized so

    @property
    def out_features(self) -> int:
        weight = self.weight
        return (weight.codes if isinstance(weight, QuantizedWeight) else weight).shape[0]


def _per_row(weight: QuantizedWeight) -> QuantizedWeight:
    """One per-tensor scale repeated on every output row: the same weights, stackable with other parts."""
    if weight.args.strategy != "tensor":
        return weight
    rows = weight.codes.shape[0]
    return replace(
        weight, scale=weight.scale.reshape(1, 1).expand(rows, 1).contiguous(),
        zero_point=weight.zero_point.reshape(1, 1).expand(rows, 1).contiguous(), args=replace(weight.args, strategy="channel"),
    )


def _stackable(weights: list) -> bool:
    if not all(isinstance(weight, QuantizedWeight) and weight.g_idx is None for weight in weights):
        return False
    formats = {(replace(w.args, strategy="channel") if w.args.strategy == "tensor" else w.args, w.input_activations) for w in weights}
    return len(formats) == 1


def merge(parts: list[LinearWeight]) -> LinearWeight:
    """Stack projections that read the same input (q/k/v, gate/up) into one matmul. Static input scales of parts
    that read the same input are calibrated on the same activations; should they differ, the one covering the widest
    range serves all (the largest scale, or NVFP4's smallest global scale)."""
    if len(parts) == 1:
        return parts[0]
    weights = [part.weight for part in parts]
    if _stackable(weights):
        rowwise = [_per_row(w) for w in weights]
        weight = QuantizedWeight(
            torch.cat([w.codes for w in rowwise]), torch.cat([w.scale for w in rowwise]),
            torch.cat([w.zero_point for w in rowwise]), rowwise[0].args, None, rowwise[0].input_activations,
        )
    else:  # formats differ: run the group dense
        weight = torch.cat([w.dequantize() if isinstance(w, QuantizedWeight) else w for w in weights])
    bias = None
    if any(part.bias is not None for part in parts):
        bias = torch.cat([part.bias if part.bias is not None else torch.zeros(part.out_features) for part in parts])
    calibrated = [part for part in parts if part.input_scale is not None]
    input_scale = None
    if calibrated:
        stacked = torch.stack([part.input_scale.reshape(()) for part in calibrated])
        # a global scale divides the range it covers: the smallest covers the widest
        is_global = static_input_name(calibrated[0].weight.input_activations) == "input_global_scale"
        input_scale = (stacked.amin() if is_global else stacked.amax()).reshape(1)
    return LinearWeight(weight, bias, input_scale)
