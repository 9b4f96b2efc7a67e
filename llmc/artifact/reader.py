"""Reading an artifact back: packed Linears are unpacked and dequantized with llmc's own arithmetic."""
import json
from pathlib import Path

import torch

from llmc.artifact.compressed_tensors import weight_args_from_config
from llmc.artifact.pack import unpack_int32
from llmc.models.checkpoint import CheckpointReader
from llmc.quant.qtypes import QuantArgs, QuantizedWeight
from llmc.quant.targets import matches

PACKED_SUFFIX = ".weight_packed"


def is_artifact(folder: Path) -> bool:
    config = folder / "config.json"
    if not config.is_file():
        return False
    quantization = json.loads(config.read_text()).get("quantization_config") or {}
    return quantization.get("quant_method") == "compressed-tensors"


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


def dense_state_dict(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    config = json.loads((folder / "config.json").read_text())
    groups = weight_args_from_config(config["quantization_config"])
    reader = CheckpointReader(folder)
    state = {}
    for name in reader.file_of:
        if name.endswith(PACKED_SUFFIX):
            module = name.removesuffix(PACKED_SUFFIX)
            args = quant_args_of(module, groups)
            state[f"{module}.weight"] = read_quantized_weight(reader, module, args).dequantize().to(dtype)
        elif not name.rsplit(".", 1)[-1].startswith(("weight_scale", "weight_shape", "weight_zero_point")):
            state[name] = reader.tensor(name).to(dtype)
    return state


def quant_args_of(module: str, groups: list[tuple[list[str], QuantArgs]]) -> QuantArgs:
    return next(args for targets, args in groups if "Linear" in targets or matches(module, torch.nn.Identity(), targets))
