"""Calibrated scales taken on a layer's final pass (weights already quantized, what inference will see): per-tensor
input scales for Linears with static activations (NVFP4's: the global scale of its dynamic group scales), and the KV
cache's k_scale / v_scale. They become buffers of the modules (`<linear>.input_scale` or `input_global_scale`,
`<attention>.k_scale` / `v_scale`, NVFP4's `k_global_scale` / `v_global_scale`), so the artifact writer stores them."""
from contextlib import contextmanager

import torch
from torch import nn

from llmc.quant.kvcache import KVObserver
from llmc.quant.layer import quantizing_inputs_of, recording
from llmc.quant.qtypes import QuantArgs, compute_qparams, global_scale_of, kv_scale_names, static_input_name
from llmc.quant.ranks import SINGLE, Ranks


@contextmanager
def observing_scales(layer: nn.Module, prefix: str, static_inputs: dict[str, QuantArgs], kv_args: QuantArgs | None,
                     ranks: Ranks = SINGLE):
    """Records during the `with` body, then attaches the scales (of the ranges over every rank's samples)."""
    absmax: dict[str, torch.Tensor] = {}

    def record(name: str, inputs: torch.Tensor) -> None:
        batch_max = inputs.abs().amax()
        absmax[name] = torch.maximum(absmax[name], batch_max) if name in absmax else batch_max

    linears = {name: layer.get_submodule(name.removeprefix(f"{prefix}.")) for name in static_inputs}
    attention = layer.get_submodule("self_attn") if kv_args is not None else None
    if attention is not None:
        attention.kv_hook = KVObserver(kv_args)
    try:
        with recording(linears, record):
            yield
    finally:
        observer = attention.kv_hook if attention is not None else None
        if attention is not None:
            del attention.kv_hook
    for name, linear in linears.items():
        absmax[name] = ranks.max(absmax[name])
        args = static_inputs[name]
        if args.dynamic == "local":
            scale = global_scale_of(absmax[name])
        else:
            scale, _ = compute_qparams(-absmax[name], absmax[name], args, torch.float32)
        linear.register_buffer(static_input_name(args), scale.reshape(1))
    if observer is not None:
        observer.absmax = [ranks.max(absmax) for absmax in observer.absmax]
        for name, scale in zip(kv_scale_names(kv_args), observer.scales()):
            attention.register_buffer(name, scale)


@contextmanager
def quantizing_inputs(layer: nn.Module, prefix: str, activations: dict[str, QuantArgs]):
    """During the `with` body each Linear with quantized inputs fake-quantizes them as inference will (static ones with
    the scale calibrated before), so that the outputs handed to the next layer carry this layer's activation
    quantization, as the served model's do."""
    handles = []
    for name, args in activations.items():
        linear = layer.get_submodule(name.removeprefix(f"{prefix}."))
        static = getattr(linear, static_input_name(args)) if static_input_name(args) else None
        handles.append(quantizing_inputs_of(linear, args, static))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
