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
    g_idx = reader.tensor(f"{name}.weight_g_idx") if f"{name}.weight_g_idx" in reader else None
    return QuantizedWeight(codes, scale, zero_point.contiguous(), args, g_idx)


def dense_state_dict(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    config = json.loads((folder / "config.json").read_text())
    groups = weight_args_from_config(config["quantization_config"])
    reader = CheckpointReader(folder)
    state = {}
    for name in reader.file_of:
        if name.endswith(PACKED_SUFFIX):
            module = name.removesuffix(PACKED_SUFFIX)
            args = next(args for targets, args in groups if _targets_module(module, targets))
            state[f"{module}.weight"] = read_quantized_weight(reader, module, args).dequantize().to(dtype)
        elif not name.rsplit(".", 1)[-1].startswith(("weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")):
            state[name] = reader.tensor(name).to(dtype)
    return state


def _targets_module(name: str, targets: list[str]) -> bool:
    return "Linear" in targets or matches(name, torch.nn.Identity(), targets)
