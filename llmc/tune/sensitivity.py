"""Each Linear's sensitivity to each candidate format, measured once, layer by layer as calibration runs: the
decoder layer's output error (||y_q - y||² / ||y||² on a few calibration samples) with only that unit quantized,
by round-to-nearest on the candidate's observer (and its inputs quantized, for W8A8 / FP8). A unit is what engines
stack into one matmul (q/k/v, gate/up), so it takes one format; every other Linear is a unit of its own. The same
pass records each unit's cost in every format on the objective's target."""
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from llmc.calib.data import CalibrationSet
from llmc.calib.driver import SourceModel, decoder_layers, embed, layer_linears, materialize, return_freed_memory
from llmc.calib.observers import quantizing_inputs
from llmc.quant.layer import LayerRunner
from llmc.quant.qtypes import QuantArgs, QuantizedWeight, global_scale_of, quantize_weight
from llmc.tune.hardware import Gpu, batch1_seconds, stored_bytes

Formats = dict[str, tuple[QuantArgs, QuantArgs | None] | None]  # candidate label -> (weights, inputs); None: keep


@dataclass
class Unit:
    layer: int
    names: list[str]  # full Linear names, stacked by engines when more than one
    error: dict[str, float]  # candidate label -> layer output error with this unit alone in that format (keep: 0)
    cost: dict[str, float]  # candidate label -> bytes, seconds or modelled seconds on the objective's target

    @property
    def label(self) -> str:
        leaves = [name.rsplit(".", 1)[-1] for name in self.names]
        return f"{self.layer}:{'+'.join(leaves)}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Objective:
    """How a unit's cost is counted: `smallest` (bytes), `this-machine` (seconds timed here), or a GPU (bytes over
    its bandwidth, in seconds)."""

    kind: str
    gpu: Gpu | None = None
    export_dtype: torch.dtype = torch.bfloat16

    @property
    def unit(self) -> str:
        return "bytes" if self.kind == "smallest" else "s"


def fits(args: QuantArgs, shapes: list[torch.Size]) -> bool:
    return not args.grouped or all(shape[1] % args.group_size == 0 for shape in shapes)


def quantized_unit(weights: list[torch.Tensor], args: QuantArgs, scale_dtype: torch.dtype) -> list[QuantizedWeight]:
    """Round-to-nearest, one global scale for the stacked parts where the format has one (NVFP4), as the RTN stage."""
    shared = global_scale_of(torch.stack([weight.abs().amax() for weight in weights])) if args.strategy == "tensor_group" else None
    return [quantize_weight(weight, args, scale_dtype, shared) for weight in weights]


class CostMeter:
    """Each unit's cost in a format; this-machine timings are kept by shape and format (every layer has the same)."""

    def __init__(self, objective: Objective):
        self.objective = objective
        self.timed: dict[tuple, float] = {}

    def __call__(self, names: list[str], label: str, weights: list, activations: QuantArgs | None) -> float:
        objective = self.objective
        if objective.kind == "this-machine":
            key = (label, tuple(tuple(weight.shape if isinstance(weight, torch.Tensor) else weight.codes.shape) for weight in weights))
            if key not in self.timed:
                self.timed[key] = batch1_seconds(weights, activations)
            return self.timed[key]
        stored = sum(stored_bytes(name, weight, objective.export_dtype) for name, weight in zip(names, weights))
        return float(stored) if objective.kind == "smallest" else stored / (objective.gpu.bandwidth_gb_s * 1e9)


def output_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    return float(((output - reference) ** 2).sum() / (reference**2).sum().clamp(min=1e-30))


@torch.no_grad()
def measure_units(model: SourceModel, calibration: CalibrationSet, formats: Formats, objective: Objective,
                  device: torch.device, scale_dtype: torch.dtype) -> list[Unit]:
    """Every decoder layer's units with their error and cost in each fitting format; the activations go on through
    the full-precision layer, so each unit is measured against the same inputs whatever the others take."""
    reader, family = model.reader, model.family
    runner = LayerRunner(model.skeleton, model.config, calibration.input_ids.shape[1], compute_dtype=calibration.compute_dtype,
                         device=device)
    hidden = embed(reader, family, calibration.input_ids).to(device)
    meter = CostMeter(objective)
    units = []
    layers = decoder_layers(model.skeleton, family)
    for index in tqdm(range(len(layers)), desc="sensitivity", unit="layer"):
        prefix = f"{family.layers}.{index}"
        layer = layers[index]
        materialize(layer, reader, prefix, device)
        runner.select(index)
        reference = runner(layer, hidden)
        linears = {name: linear for name, linear in layer_linears(layer, prefix).items()
                   if name.removeprefix(f"{prefix}.") not in family.full_precision}
        for names in family.fused_groups(list(linears)):
            originals = [linears[name].weight.data for name in names]
            unit = Unit(index, names, {}, {})
            for label, chosen in formats.items():
                if chosen is None:
                    unit.error[label] = 0.0
                    unit.cost[label] = meter(names, label, originals, None)
                    continue
                args, activations = chosen
                if not fits(args, [weight.shape for weight in originals]):
                    continue
                quantized = quantized_unit(originals, args, scale_dtype)
                for name, weight in zip(names, quantized):
                    linears[name].weight.data = weight.dequantize().to(originals[0].dtype)
                with quantizing_inputs(layer, prefix, dict.fromkeys(names, activations) if activations else {}):
                    unit.error[label] = output_error(runner(layer, hidden), reference)
                unit.cost[label] = meter(names, label, [weight.to(torch.device("cpu")) for weight in quantized], activations)
                for name, original in zip(names, originals):
                    linears[name].weight.data = original
            units.append(unit)
        hidden = reference
        layer.to("meta")
        return_freed_memory()
    return units
