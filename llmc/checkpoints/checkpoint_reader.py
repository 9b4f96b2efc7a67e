"""Tensor-by-tensor access to a folder of safetensors files, so that one layer can be read at a time.
Files are opened per read: a long-lived memory map would keep every page read so far resident."""
from pathlib import Path

import torch
from safetensors import safe_open

from llmc.core.errors import LlmcError


class CheckpointReader:
    def __init__(self, folder: Path):
        self.folder = folder
        self.file_of: dict[str, Path] = {}
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise LlmcError(f"{folder} has no .safetensors files (llmc does not load pickle checkpoints)")
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                self.file_of |= dict.fromkeys(handle.keys(), file)

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors([name])[name]

    def tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        missing = [name for name in names if name not in self.file_of]
        if missing:
            raise LlmcError(f"checkpoint {self.folder} has no tensor {missing[0]!r}")
        return self._read(names)

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors, every one of them known to be there."""
        result = {}
        for file in {self.file_of[name] for name in names}:
            with safe_open(str(file), framework="pt") as handle:
                result |= {name: handle.get_tensor(name).clone() for name in names if self.file_of[name] == file}
        return result

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """All tensors under `prefix.`, keyed by their name inside that module."""
        start = prefix + "."
        names = [name for name in self.file_of if name.startswith(start)]
        return {name[len(start) :]: tensor for name, tensor in self.tensors(names).items()}
