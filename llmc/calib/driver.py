"""Sequential, layer-by-layer quantization. The model is built on the meta device; each decoder layer's weights
are read from the checkpoint's safetensors when its turn comes and released after, so peak memory is one layer
plus the calibration activations whatever the depth. With calibration data each layer's inputs are the previous
layer's outputs computed with quantized weights, and each layer's output error is measured."""
import ctypes
import ctypes.util
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from llmc.calib.data import CalibrationSet
from llmc.models.checkpoint import CheckpointReader
from llmc.models.families import Family
from llmc.quant.qtypes import QuantizedWeight
from llmc.quant.stages import assign_linears

COMPUTE_DTYPE = torch.float32
EmitLayer = Callable[[str, nn.Module, dict[str, QuantizedWeight]], None]


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


def build_skeleton(config) -> nn.Module:
    """The model with every parameter on the meta device: structure only, no memory."""
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=COMPUTE_DTYPE)


def decoder_layers(skeleton: nn.Module, family: Family) -> nn.ModuleList:
    return skeleton.get_submodule(family.layers)


def layer_linears(layer: nn.Module, prefix: str) -> dict[str, nn.Linear]:
    return {f"{prefix}.{name}": module for name, module in layer.named_modules() if isinstance(module, nn.Linear)}


def materialize(layer: nn.Module, reader: CheckpointReader, prefix: str) -> None:
    layer.to_empty(device="cpu")
    state = {name: tensor.to(COMPUTE_DTYPE) for name, tensor in reader.state_dict(prefix).items()}
    layer.load_state_dict(state, strict=True)


class LayerRunner:
    """Runs one decoder layer over all calibration samples, in batches, with the model's own attention."""

    def __init__(self, skeleton: nn.Module, config, seq_len: int, batch_size: int = 8):
        rotary = type(skeleton.model.rotary_emb)(config=config)
        self.position_ids = torch.arange(seq_len).unsqueeze(0)
        probe = torch.zeros(1, seq_len, config.hidden_size, dtype=COMPUTE_DTYPE)
        self.position_embeddings = rotary(probe, self.position_ids)
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        outputs = []
        for batch in hidden.split(self.batch_size):
            out = layer(
                batch,
                attention_mask=None,  # sdpa is causal without a mask; samples have no padding
                position_ids=self.position_ids,
                position_embeddings=self.position_embeddings,
            )
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs)


def embed(reader: CheckpointReader, family: Family, input_ids: torch.Tensor) -> torch.Tensor:
    weight = reader.tensor(f"{family.embed_tokens}.weight").to(COMPUTE_DTYPE)
    return nn.functional.embedding(input_ids, weight)


def quantize_layerwise(
    reader: CheckpointReader,
    skeleton: nn.Module,
    config,
    family: Family,
    quantizers: list,
    calibration: CalibrationSet | None,
    emit: EmitLayer,
) -> list[LayerReport]:
    layers = decoder_layers(skeleton, family)
    hidden = runner = None
    if calibration is not None:
        runner = LayerRunner(skeleton, config, calibration.input_ids.shape[1])
        hidden = embed(reader, family, calibration.input_ids)
    reports = []
    for index in tqdm(range(len(layers)), desc="quantizing layers", unit="layer"):
        started = time.perf_counter()
        prefix = f"{family.layers}.{index}"
        layer = layers[index]
        materialize(layer, reader, prefix)
        reference = runner(layer, hidden) if runner else None
        quantized: dict[str, QuantizedWeight] = {}
        for quantizer, linears in zip(quantizers, assign_linears(quantizers, layer_linears(layer, prefix))):
            quantized |= quantizer.quantize_layer(linears)
        error = None
        if runner:
            hidden = runner(layer, hidden)
            error = float(((hidden - reference) ** 2).sum() / (reference**2).sum().clamp_min(1e-30))
        emit(prefix, layer, quantized)
        layer.to("meta")
        return_freed_memory()
        reports.append(LayerReport(index, time.perf_counter() - started, len(quantized), error))
    return reports
