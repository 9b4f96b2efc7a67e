import json
from pathlib import Path

import torch
from torch import nn

from llmc.artifact.ct_config import schemes_from_config
from llmc.artifact.reader import read_quantized_weight, scheme_of
from llmc.models.checkpoint import CheckpointReader
from llmc.runtime.layers.linear import LinearWeight, build_linear


class WeightLoader:
    """Reads a model's tensors from an artifact (packed int weights stay packed) or a plain HF folder."""

    def __init__(self, folder: Path, dtype: torch.dtype, device: str):
        self.reader = CheckpointReader(folder)
        self.dtype, self.device = dtype, device
        quantization = json.loads((folder / "config.json").read_text()).get("quantization_config")
        self.schemes = schemes_from_config(quantization) if quantization else []

    def __contains__(self, name: str) -> bool:
        return name in self.reader

    def tensor(self, name: str) -> torch.Tensor:
        return self.reader.tensor(name).to(self.device, self.dtype)

    def linear(self, names: list[str]) -> nn.Module:
        return build_linear([self._linear_weight(name) for name in names], self.dtype, self.device)

    def _linear_weight(self, name: str) -> LinearWeight:
        bias = self.reader.tensor(f"{name}.bias") if f"{name}.bias" in self.reader else None
        if f"{name}.weight_scale" in self.reader:
            return LinearWeight(read_quantized_weight(self.reader, name, scheme_of(name, self.schemes)[1]), bias)
        return LinearWeight(self.reader.tensor(f"{name}.weight"), bias)
