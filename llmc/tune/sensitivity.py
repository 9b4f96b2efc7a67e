"""Each Linear's sensitivity to each candidate format, measured once, layer by layer as calibration runs, as a
predicted KL of the model's next-token distribution: the decoder layer's relative output error (||y_q - y||² / ||y||²
on a few calibration samples) with only that unit quantized, by round-to-nearest on the candidate's observer (and its
inputs quantized, for W8A8 / FP8), times the layer's gain: the KL at the logits per unit of relative error at that
layer's output. The gain is measured in the same pass: each layer's output, perturbed along its own quantization error
(every unit in its cheapest format) scaled to a small fixed size, goes on through the later layers as they come, and
its KL at the logits is taken at the end. A unit is what engines stack into one matmul (q/k/v, gate/up), so it takes
one format; every other Linear is a unit of its own. The same pass records each unit's cost in every format on the
objective's target."""
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
    error: dict[str, float]  # candidate label -> predicted KL with this unit alone in that format (keep: 0)
    cost: dict[str, float]  # candidate label -> bytes, seconds or modelled seconds on the objective's target
    gain: float = 1.0  # the layer's KL at the logits per unit of relative output error (error = gain x output error)

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


PROBE_ERROR = 1e-3  # the relative output error a layer's probe is scaled to: small enough that KL grows linearly in it
GAIN_SAMPLES = 4  # of the sensitivity samples, those the probes carry to the logits


class Head:
    """The final norm and LM head: next-token log-probabilities of a residual stream, a sample at a time."""

    def __init__(self, model: SourceModel, device: torch.device):
        from llmc.quant.lm_head import head_weight

        family = model.family
        self.norm = model.skeleton.get_submodule(family.final_norm)
        self.norm.to_empty(device=device)
        self.norm.load_state_dict({name: tensor.to(device, torch.float32)
                                   for name, tensor in model.reader.state_dict(family.final_norm).items()})
        self.weight = head_weight(model.reader, family).to(device, torch.float32)
        self.softcap = getattr(model.config, "final_logit_softcapping", None)

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(self.norm(hidden.float()), self.weight)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return torch.log_softmax(logits, dim=-1)

    def kl(self, reference: torch.Tensor, other: torch.Tensor) -> float:
        """Mean KL(reference || other) per token."""
        total = 0.0
        for ref, oth in zip(reference, other):
            log_p, log_q = self.log_probs(ref), self.log_probs(oth)
            total += float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
        return total / len(reference)


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
    probes: list[torch.Tensor] = []  # per layer so far, its perturbed output carried through the later layers
    layers = decoder_layers(model.skeleton, family)
    for index in tqdm(range(len(layers)), desc="sensitivity", unit="layer"):
        prefix = f"{family.layers}.{index}"
        layer = layers[index]
        materialize(layer, reader, prefix, device)
        runner.select(index)
        probes = [runner(layer, probe) for probe in probes]
        reference = runner(layer, hidden)
        linears = {name: linear for name, linear in layer_linears(layer, prefix).items()
                   if name.removeprefix(f"{prefix}.") not in family.full_precision}
        probes.append(probe_of(layer, linears, family, formats, runner, hidden[:GAIN_SAMPLES], reference[:GAIN_SAMPLES],
                               scale_dtype))
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
    head = Head(model, device)
    gains = [head.kl(hidden[:GAIN_SAMPLES], probe) / PROBE_ERROR for probe in tqdm(probes, desc="layer gains", unit="layer")]
    for unit in units:
        unit.gain = gains[unit.layer]
        unit.error = {label: error * unit.gain for label, error in unit.error.items()}
    return units


def probe_of(layer, linears: dict, family, formats: Formats, runner: LayerRunner, hidden: torch.Tensor,
             reference: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output moved along the error of every unit in its cheapest fitting format, scaled to PROBE_ERROR."""
    originals = {name: linear.weight.data for name, linear in linears.items()}
    for names in family.fused_groups(list(linears)):
        weights = [originals[name] for name in names]
        fitting = [chosen for chosen in formats.values() if chosen is not None and fits(chosen[0], [w.shape for w in weights])]
        if fitting:
            args = min(fitting, key=lambda chosen: chosen[0].num_bits * 1000 + (chosen[0].group_size or 10**6))[0]
            for name, weight in zip(names, quantized_unit(weights, args, scale_dtype)):
                linears[name].weight.data = weight.dequantize().to(weights[0].dtype)
    perturbed = runner(layer, hidden)
    for name, original in originals.items():
        linears[name].weight.data = original
    error = perturbed - reference
    scale = (PROBE_ERROR * float((reference**2).sum()) / max(float((error**2).sum()), 1e-30)) ** 0.5
    return reference + error * scale
