"""Writing an artifact: shards streamed layer by layer into a staging folder that is renamed into place only
when complete, so an error or Ctrl-C never leaves a partial artifact."""
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from llmc.artifact.compressed_tensors import compressed_tensors_tensors
from llmc.artifact.output import check_output
from llmc.quant.qtypes import QuantizedWeight

PackLinear = Callable[[str, QuantizedWeight], dict[str, torch.Tensor]]
MANIFEST = "llmc.json"
INDEX = "model.safetensors.index.json"


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def killed_staging(output: Path) -> list[Path]:
    """The staging folders for output left behind by runs killed outright (SIGKILL, the OOM killer, a lost
    machine): those whose process is gone."""
    folders = []
    for folder in output.parent.glob(f".{output.name}.partial-*"):
        pid = folder.name.rsplit("-", 1)[1]
        if pid.isdigit() and not process_alive(int(pid)):
            folders.append(folder)
    return folders


def remove_stale_staging(output: Path) -> None:
    """Remove the killed runs' staging folders, saying so."""
    for folder in killed_staging(output):
        shutil.rmtree(folder, ignore_errors=True)
        pid = folder.name.rsplit("-", 1)[1]
        print(f"removed {folder}, left behind by process {pid}, which no longer runs", file=sys.stderr)


@contextmanager
def staged_folder(output: Path, overwrite: bool = False, adopt: Path | None = None):
    """adopt: a killed run's staging folder to continue in (`--resume`), renamed to this process's."""
    check_output(output, overwrite)
    staging = output.with_name(f".{output.name}.partial-{os.getpid()}")
    if adopt is not None:
        adopt.rename(staging)
    remove_stale_staging(output)
    if adopt is None:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if output.exists():
        shutil.rmtree(output)
    staging.rename(output)


class ShardWriter:
    """One safetensors shard per decoder layer plus one for the rest, with the HF index over them."""

    def __init__(self, folder: Path, num_shards: int, dtype: torch.dtype, tensors_of: PackLinear = compressed_tensors_tensors):
        self.folder = folder
        self.num_shards = num_shards
        self.dtype = dtype
        self.tensors_of = tensors_of
        self.weight_map: dict[str, str] = {}
        self.total_size = 0
        self.last_written: tuple[str, dict[str, int]] | None = None  # the last shard and its tensors' sizes

    def restore(self, shards: list[tuple[str, dict[str, int]]]) -> None:
        """Continue after shards written earlier (a resumed run): each its file name and its tensors' sizes."""
        for filename, tensor_bytes in shards:
            self.weight_map |= dict.fromkeys(tensor_bytes, filename)
            self.total_size += sum(tensor_bytes.values())

    def write_layer(self, prefix: str, layer: nn.Module, quantized: dict[str, QuantizedWeight]) -> None:
        tensors = {}
        for name, weight in quantized.items():
            tensors |= self.tensors_of(name, weight)
        quantized_params = {f"{name}.weight" for name in quantized}
        for name, param in layer.state_dict().items():
            full_name = f"{prefix}.{name}"
            if full_name not in quantized_params:
                tensors[full_name] = param.to(self.dtype)
        self.write(tensors)

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        filename = f"model-{len(set(self.weight_map.values())) + 1:05d}-of-{self.num_shards:05d}.safetensors"
        tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
        save_file(tensors, str(self.folder / filename), metadata={"format": "pt"})
        tensor_bytes = {name: tensor.numel() * tensor.element_size() for name, tensor in tensors.items()}
        self.restore([(filename, tensor_bytes)])
        self.last_written = filename, tensor_bytes

    def write_index(self) -> None:
        index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def sha256_of_file(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def sha256_of_files(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): sha256_of_file(path)
            for path in sorted(folder.rglob("*")) if path.is_file() and path.name != MANIFEST}


def write_manifest(folder: Path, manifest: dict) -> None:
    manifest = {**manifest, "files": sha256_of_files(folder)}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
