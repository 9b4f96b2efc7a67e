"""Sequential, layer-by-layer quantization. The model is built on the meta device; each decoder layer's weights
are read from the checkpoint's safetensors when its turn comes and released after, so peak memory is one layer
plus the calibration activations whatever the depth. With calibration data each layer's inputs are the previous
layer's outputs computed with quantized weights, stages that need data see the inputs of the modules they
observe, and each layer's output error is measured. The last pass over each layer also calibrates the static input
scales and the KV-cache scales; where inputs are quantized, one more pass with them quantized as served (with those
scales) gives the next layer its inputs."""
import copy
import ctypes
import ctypes.util
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn
from tqdm import tqdm
from transformers import PretrainedConfig

from llmc.calib.data import CalibrationSet
from llmc.calib.memory import activations_fit_device
from llmc.calib.observers import observing_scales, quantizing_inputs
from llmc.checkpoints.calibration_moe import linearize_experts
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.checkpoints.families import Family, family_for
from llmc.quant.kvcache import KV_ATTENTION
from llmc.quant.layer import COMPUTE_DTYPE, CPU, LayerRunner, LayerWork, recording
from llmc.quant.plan import QuantizationPlan
from llmc.quant.qtypes import QuantArgs, QuantizedWeight, static_input_name
from llmc.quant.ranks import SINGLE, Ranks
from llmc.quant.stage import StageRun

EmitLayer = Callable[[str, nn.Module, dict[str, QuantizedWeight], "LayerReport"], None]


def return_freed_memory() -> None:
    """Hand freed heap pages back to the OS; without it glibc keeps each released layer's pages and peak
    memory grows with depth."""
    libc_name = ctypes.util.find_library("c")
    if libc_name and hasattr(ctypes.CDLL(libc_name), "malloc_trim"):
        ctypes.CDLL(libc_name).malloc_trim(0)


@dataclass
class LayerReport:
    index: int
    seconds: float
    num_quantized: int
    output_error: float | None  # ||y_quantized - y||^2 / ||y||^2 on the calibration inputs


@dataclass
class Resumption:
    """The layers a killed run finished (`--resume`): their reports, and each one's weights as written (a layer's
    prefix -> its state dict), which the calibration activations pass through again."""

    reports: list[LayerReport]
    written_state: Callable[[str], dict[str, torch.Tensor]]


@dataclass
class SourceModel:
    """The model being quantized: its checkpoint's tensors, read a layer at a time, and its structure."""

    reader: CheckpointReader
    skeleton: nn.Module  # build_skeleton's: every parameter on the meta device
    config: PretrainedConfig
    family: Family


@dataclass
class LayerwiseQuantization:
    """What each decoder layer goes through, and where."""

    stages: list[StageRun]  # the recipe's, in order
    plan: QuantizationPlan
    calibration: CalibrationSet | None  # None: data-free stages only, and no output error measured
    kv_cache: QuantArgs | None = None  # the KV cache's format, whose scales the last pass over each layer calibrates
    device: torch.device = CPU
    stored_dtype: torch.dtype = COMPUTE_DTYPE  # what the artifact stores unquantized parameters in
    ranks: Ranks = SINGLE  # the processes calibrating together, this one on its share of the samples


def build_skeleton(config) -> nn.Module:
    """The model with every parameter on the meta device: structure only, no memory. Sparse MoE blocks hold their
    experts as Linears under the checkpoint's names (checkpoints/calibration_moe.py)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config._attn_implementation = KV_ATTENTION  # sdpa, with a hook for the KV-cache observer
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=COMPUTE_DTYPE)
    linearize_experts(skeleton, family_for(config))
    return skeleton


def decoder_layers(skeleton: nn.Module, family: Family) -> nn.ModuleList:
    return skeleton.get_submodule(family.layers)


def layer_linears(layer: nn.Module, prefix: str) -> dict[str, nn.Linear]:
    return {f"{prefix}.{name}": module for name, module in layer.named_modules() if isinstance(module, nn.Linear)}


def decoder_linears(skeleton: nn.Module, family: Family) -> dict[str, nn.Linear]:
    """Every decoder layer's Linears by full name that the stages may quantize: not the LM head, nor the family's
    full-precision ones (MoE routers)."""
    linears = {}
    for index, layer in enumerate(decoder_layers(skeleton, family)):
        prefix = f"{family.layers}.{index}"
        linears |= {name: linear for name, linear in layer_linears(layer, prefix).items()
                    if name.removeprefix(f"{prefix}.") not in family.full_precision}
    return linears


def materialize(layer: nn.Module, reader: CheckpointReader, prefix: str, device: torch.device = CPU) -> None:
    """The layer's weights from the checkpoint straight onto the device, in the compute dtype."""
    layer.to_empty(device=device)
    state = {name: tensor.to(device, COMPUTE_DTYPE) for name, tensor in reader.state_dict(prefix).items()}
    layer.load_state_dict(state, strict=True)


def embed(reader: CheckpointReader, family: Family, input_ids: torch.Tensor) -> torch.Tensor:
    weight = reader.tensor(f"{family.embed_tokens}.weight").to(COMPUTE_DTYPE)
    embedded = nn.functional.embedding(input_ids, weight)
    return embedded * weight.shape[1] ** 0.5 if family.embedding_scale else embedded


def round_as_stored(layer: nn.Module, prefix: str, quantized: dict[str, QuantizedWeight], stored_dtype: torch.dtype) -> None:
    """The layer's unquantized parameters (norms, biases, what a stage folded scales into) rounded to the dtype the
    artifact stores them in: the next layer calibrates on the outputs of the layer as served, and a resumed run,
    which recomputes them from the artifact's shards, gets the same ones."""
    for name, param in layer.named_parameters():
        if not (name.endswith(".weight") and f"{prefix}.{name.removesuffix('.weight')}" in quantized):
            param.data = param.data.to(stored_dtype).to(param.dtype)


def replay_finished(model: SourceModel, resumed: Resumption, runner: LayerRunner, hidden: torch.Tensor,
                    device: torch.device) -> torch.Tensor:
    """The calibration activations after the finished layers, through their weights as written."""
    layers = decoder_layers(model.skeleton, model.family)
    for index in tqdm(range(len(resumed.reports)), desc="replaying finished layers", unit="layer"):
        layer, prefix = layers[index], f"{model.family.layers}.{index}"
        layer.to_empty(device=device)
        layer.load_state_dict({name: tensor.to(device, COMPUTE_DTYPE) for name, tensor in resumed.written_state(prefix).items()})
        runner.select(index)
        hidden = runner(layer, hidden)
        layer.to("meta")
    return hidden


def activations_home(hidden: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The calibration activations on the device when they fit, else pinned in host memory (a CUDA run) or as they are."""
    if activations_fit_device(hidden.numel() * hidden.element_size(), device):
        return hidden.to(device)
    return hidden.pin_memory() if device.type == "cuda" else hidden


def quantize_layerwise(model: SourceModel, quantization: LayerwiseQuantization, emit: EmitLayer | None = None,
                       resumed: Resumption | None = None) -> list[LayerReport]:
    """One layer at a time on the device: its weights, its statistics and a batch of activations at least; what
    emit gets (each finished layer, to write) is back on the host. Every rank runs the same layers; only one that
    writes them passes emit."""
    stages, plan, device, ranks = quantization.stages, quantization.plan, quantization.device, quantization.ranks
    reader, family, calibration = model.reader, model.family, quantization.calibration
    layers = decoder_layers(model.skeleton, family)
    hidden = runner = None
    reports = list(resumed.reports) if resumed else []
    if calibration is not None:
        runner = LayerRunner(model.skeleton, model.config, calibration.input_ids.shape[1], compute_dtype=calibration.compute_dtype,
                             device=device)
        input_ids = calibration.input_ids[ranks.samples(len(calibration.input_ids))]
        hidden = activations_home(embed(reader, family, input_ids), device)
        if resumed:
            hidden = replay_finished(model, resumed, runner, hidden, device)
    for index in tqdm(range(len(reports), len(layers)), desc="quantizing layers", unit="layer", initial=len(reports), total=len(layers),
                      disable=ranks.rank != 0):
        started = time.perf_counter()
        prefix = f"{family.layers}.{index}"
        layer = layers[index]
        materialize(layer, reader, prefix, device)
        if runner:
            runner.select(index)
        linears = layer_linears(layer, prefix)
        weights = plan.layer_weights(linears)
        reference = None
        quantized: dict[str, QuantizedWeight] = {}
        for position, stage in enumerate(stages):
            work = LayerWork(layer, prefix, plan.stage_linears(position, linears), weights, runner, ranks)
            observed = stage.observed_modules(work) if runner else {}
            if observed or (runner and position == 0):  # the first pass, before any change, is the reference
                with recording(observed, stage.record):
                    outputs = runner(layer, hidden)
                if position == 0:
                    reference = outputs
            quantized |= stage.process(work)
        activations = plan.layer_activations(linears)
        quantized = {name: replace(weight, input_activations=activations.get(name)) for name, weight in quantized.items()}
        error = None
        if runner:
            round_as_stored(layer, prefix, quantized, quantization.stored_dtype)
            static_inputs = {name: args for name, args in activations.items() if static_input_name(args)}
            if static_inputs or quantization.kv_cache is not None or not activations:
                with observing_scales(layer, prefix, static_inputs, quantization.kv_cache, ranks):
                    next_hidden = runner(layer, hidden)
            if activations:  # with the inputs quantized as served (by the scales just observed): the next layer's inputs
                with quantizing_inputs(layer, prefix, activations):
                    next_hidden = runner(layer, hidden)
            hidden = next_hidden
            if reference is not None:  # None when no stage changes weights (only the KV cache is calibrated)
                error_sum, reference_sum = ranks.sum_floats(float(((hidden - reference) ** 2).sum()), float((reference**2).sum()))
                error = error_sum / max(reference_sum, 1e-30)
        report = LayerReport(index, time.perf_counter() - started, len(quantized), error)
        if emit is not None:
            emit(prefix, layer.to(CPU), {name: weight.to(CPU) for name, weight in quantized.items()}, report)
        layer.to("meta")
        return_freed_memory()
        reports.append(report)
    return reports
