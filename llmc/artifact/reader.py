"""Reading an artifact back: packed Linears (compressed-tensors, or the legacy GPTQ and AWQ layouts) are unpacked
and dequantized with llmc's own arithmetic."""
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from llmc.artifact.awq_format import args_from_awq_config, read_awq_weight
from llmc.artifact.compressed_tensors import weight_args_from_config
from llmc.artifact.gptq_format import args_from_gptq_config, read_gptq_weight
from llmc.artifact.pack import unpack_int32
from llmc.models.checkpoint import CheckpointReader
from llmc.quant.qtypes import QuantArgs, QuantizedWeight
from llmc.quant.targets import matches

PACKED_SUFFIX = ".weight_packed"
QUANT_METHODS = ("compressed-tensors", "gptq", "awq")


@dataclass
class Layout:
    packed_suffix: str  # the tensor that marks a quantized Linear
    auxiliary: tuple[str, ...]  # the Linear's other tensors, not parameters of a dense model
    read: Callable[[CheckpointReader, str], QuantizedWeight]


def is_artifact(folder: Path) -> bool:
    config = folder / "config.json"
    if not config.is_file():
        return False
    quantization = json.loads(config.read_text()).get("quantization_config") or {}
    return quantization.get("quant_method") in QUANT_METHODS


def read_quantized_weight(reader: CheckpointReader, name: str, args: QuantArgs) -> QuantizedWeight:
    out_features, in_features = reader.tensor(f"{name}.weight_shape").tolist()
    codes = unpack_int32(reader.tensor(f"{name}{PACKED_SUFFIX}"), args.num_bits, in_features)
    scale = reader.tensor(f"{name}.weight_scale")
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
        return Layout(".qweight", ("qzeros", "scales", "g_idx"), lambda r, n: read_gptq_weight(r, n, args, checkpoint_format))
    if method == "awq":
        args = args_from_awq_config(quantization)
        return Layout(".qweight", ("qzeros", "scales"), lambda r, n: read_awq_weight(r, n, args))
    groups = weight_args_from_config(quantization)

    def read(reader: CheckpointReader, name: str) -> QuantizedWeight:
        return read_quantized_weight(reader, name, quant_args_of(name, groups))

    return Layout(PACKED_SUFFIX, ("weight_scale", "weight_shape", "weight_zero_point"), read)


def dense_state_dict(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    config = json.loads((folder / "config.json").read_text())
    layout = layout_of(config["quantization_config"])
    reader = CheckpointReader(folder)
    state = {}
    for name in reader.file_of:
        if name.endswith(layout.packed_suffix):
            module = name.removesuffix(layout.packed_suffix)
            state[f"{module}.weight"] = layout.read(reader, module).dequantize().to(dtype)
        elif name.rsplit(".", 1)[-1] not in layout.auxiliary:
            state[name] = reader.tensor(name).to(dtype)
    return state


def quant_args_of(module: str, groups: list[tuple[list[str], QuantArgs]]) -> QuantArgs:
    return next(args for targets, args in groups if "Linear" in targets or matches(module, torch.nn.Identity(), targets))
