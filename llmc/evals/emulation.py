"""Evaluation of an artifact in full precision that still sees what the runtime quantizes: each Linear with
quantized inputs fake-quantizes them in a forward pre-hook, and attention quantizes K and V with the calibrated
scales before using them."""
from torch import nn

from llmc.artifact.reader import RuntimeQuantization
from llmc.quant.kvcache import KV_ATTENTION, KVFakeQuantizer
from llmc.quant.layer import quantizing_inputs_of


def emulate_runtime_quantization(model: nn.Module, runtime: RuntimeQuantization) -> None:
    for name, (args, static_scale) in runtime.inputs.items():
        quantizing_inputs_of(model.get_submodule(name), args, static_scale)
    if runtime.kv_cache is None:
        return
    for name, (k_scale, v_scale) in runtime.kv_scales.items():
        model.get_submodule(name).kv_hook = KVFakeQuantizer(runtime.kv_cache, k_scale, v_scale)
    model.set_attn_implementation(KV_ATTENTION)
