"""Tensor-by-tensor access to a folder of safetensors files, so that one layer can be read at a time."""
import json
from pathlib import Path

import torch
from safetensors import safe_open

from llmc.errors import LlmcError


class CheckpointReader:
    def __init__(self, folder: Path):
        self.folder = folder
        self.file_of: dict[str, Path] = {}
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise LlmcError(f"{folder} has no .safetensors files (llmc does not load pickle checkpoints)")
        self._handles = {file: safe_open(str(file), framework="pt") for file in files}
        for file, handle in self._handles.items():
            for name in handle.keys():
                self.file_of[name] = file

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.file_of:
            raise LlmcError(f"checkpoint {self.folder} has no tensor {name!r}")
        return self._handles[self.file_of[name]].get_tensor(name)

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """All tensors under `prefix.`, keyed by their name inside that module."""
        start = prefix + "."
        return {name[len(start) :]: self.tensor(name) for name in self.file_of if name.startswith(start)}

    def metadata(self) -> dict:
        index = self.folder / "model.safetensors.index.json"
        return json.loads(index.read_text()).get("metadata", {}) if index.is_file() else {}
