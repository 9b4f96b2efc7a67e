"""Reading an artifact back: quantized Linears (compressed-tensors, or the legacy GPTQ and AWQ layouts) are unpacked
and dequantized with llmc's own arithmetic; what quantizes activations and the KV cache at run time (formats,
static input scales, the KV cache's scales) is read alongside for evaluation to emulate."""
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmc.artifact.awq_format import args_from_awq_config, read_awq_weight
from llmc.artifact.ct_config import kv_cache_args_from_config, schemes_from_config
from llmc.artifact.gptq_format import args_from_gptq_config, read_gptq_weight
from llmc.artifact.pack import from_e8m0, unpack_e2m1, unpack_int32
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.quant.qtypes import QuantArgs, QuantizedWeight, kv_scale_names, static_input_name
from llmc.quant.targets import matches

DRAFT_DIR = "draft"  # the draft heads, inside the artifact
PACKED_SUFFIX = ".weight_packed"
QUANT_METHODS = ("compressed-tensors", "gptq", "awq")
KV_SCALES = ("k_scale", "v_scale", "k_global_scale", "v_global_scale")


@dataclass
class Layout:
    marker: str  # the tensor that marks a quantized Linear; the Linear's other tensors but its bias are not parameters
    read: Callable[[CheckpointReader, str], QuantizedWeight]


@dataclass
class RuntimeQuantization:
    """What an artifact quantizes at run time: each Linear's input format with its static scale (None when
    dynamic), and the KV cache's format with each attention module's (k_scale, v_scale)."""

    inputs: dict[str, tuple[QuantArgs, torch.Tensor | None]]
    kv_cache: QuantArgs | None
    kv_scales: dict[str, tuple[torch.Tensor, torch.Tensor]]


def is_artifact(folder: Path) -> bool:
    config = folder / "config.json"
    if not config.is_file():
        return False
    quantization = json.loads(config.read_text()).get("quantization_config") or {}
    return quantization.get("quant_method") in QUANT_METHODS


def read_scale(reader: CheckpointReader, name: str, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scale codes are multiplied by, and the global scale (NVFP4)."""
    scale = reader.tensor(f"{name}.weight_scale")
    if args.is_mx:
        return from_e8m0(scale), None
    if args.strategy == "tensor_group":
        global_scale = reader.tensor(f"{name}.weight_global_scale").float().reshape(1)
        return scale.float() / global_scale, global_scale
    return scale, None


def read_quantized_weight(reader: CheckpointReader, name: str, args: QuantArgs) -> QuantizedWeight:
    scale, global_scale = read_scale(reader, name, args)
    if args.is_fp4:
        codes = unpack_e2m1(reader.tensor(f"{name}{PACKED_SUFFIX}"))
        return QuantizedWeight(codes, scale, torch.zeros_like(scale, dtype=torch.int8), args, global_scale=global_scale)
    if f"{name}{PACKED_SUFFIX}" not in reader.file_of:  # int-quantized / float-quantized: codes stored as they are
        zero_point = reader.tensor(f"{name}.weight_zero_point") if not args.symmetric else torch.zeros_like(scale, dtype=torch.int8)
        return QuantizedWeight(reader.tensor(f"{name}.weight"), scale, zero_point, args)
    out_features, in_features = reader.tensor(f"{name}.weight_shape").tolist()
    codes = unpack_int32(reader.tensor(f"{name}{PACKED_SUFFIX}"), args.num_bits, in_features)
    if args.symmetric:
        zero_point = torch.zeros_like(scale, dtype=torch.int8)
    else:
        packed_zero_point = reader.tensor(f"{name}.weight_zero_point")
        zero_point = unpack_int32(packed_zero_point.t().contiguous(), args.num_bits, out_features).t()
    return QuantizedWeight(codes, scale, zero_point.contiguous(), args)


def layout_of(quantization: dict) -> Layout:
    method = quantization["quant_method"]
    if method == "gptq":
        args, checkpoint_format = args_from_gptq_config(quantization), quantization.get("checkpoint_format", "gptq")
        return Layout(".qweight", lambda r, n: read_gptq_weight(r, n, args, checkpoint_format))
    if method == "awq":
        args = args_from_awq_config(quantization)
        return Layout(".qweight", lambda r, n: read_awq_weight(r, n, args))
    schemes = schemes_from_config(quantization)

    def read(reader: CheckpointReader, name: str) -> QuantizedWeight:
        return read_quantized_weight(reader, name, scheme_of(name, schemes)[1])

    return Layout(".weight_scale", read)


def dense_state_dict(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    config = json.loads((folder / "config.json").read_text())
    return dense_tensors(CheckpointReader(folder), layout_of(config["quantization_config"]), dtype)


def dense_tensors(reader: CheckpointReader, layout: Layout, dtype: torch.dtype, prefix: str = "") -> dict[str, torch.Tensor]:
    """The model's parameters as a dense state dict, quantized Linears dequantized; with a prefix, those of one
    module, keyed by their names inside it."""
    names = [name for name in reader.file_of if name.startswith(prefix)]
    quantized = {name.removesuffix(layout.marker) for name in names if name.endswith(layout.marker)}
    state = {}
    for name in names:
        module, leaf = name.rsplit(".", 1)
        if name.endswith(layout.marker):
            state[f"{module}.weight"] = layout.read(reader, module).dequantize().to(dtype)
        elif (module not in quantized or leaf == "bias") and leaf not in KV_SCALES:
            state[name] = reader.tensor(name).to(dtype)
    return {name.removeprefix(prefix): tensor for name, tensor in state.items()}


def runtime_quantization(folder: Path) -> RuntimeQuantization:
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    if quantization["quant_method"] != "compressed-tensors":
        return RuntimeQuantization({}, None, {})
    schemes = schemes_from_config(quantization)
    reader = CheckpointReader(folder)
    inputs = {}
    for name in reader.file_of:
        if name.endswith(".weight_scale"):
            module = name.removesuffix(".weight_scale")
            acts = scheme_of(module, schemes)[2]
            if acts is not None:
                static = static_input_name(acts)
                inputs[module] = (acts, None if static is None else reader.tensor(f"{module}.{static}").float())
    kv_cache = kv_cache_args_from_config(quantization)
    kv_scales = {}
    if kv_cache is not None:
        k_name, v_name = kv_scale_names(kv_cache)
        modules = [name.removesuffix(f".{k_name}") for name in reader.file_of if name.endswith(f".{k_name}")]
        kv_scales = {module: (reader.tensor(f"{module}.{k_name}").float(), reader.tensor(f"{module}.{v_name}").float())
                     for module in modules}
    return RuntimeQuantization(inputs, kv_cache, kv_scales)


QUANTIZED_MODULE = torch.nn.Linear(1, 1, device="meta")  # what every quantized tensor group of an artifact belongs to


def scheme_of(name: str, schemes: list[tuple]) -> tuple:
    return next(scheme for scheme in schemes if matches(name, QUANTIZED_MODULE, scheme[0]))
