"""Writing an artifact: shards streamed layer by layer into a staging folder that is renamed into place only
when complete, so an error or Ctrl-C never leaves a partial artifact. Once a layer is finished (the staging folder
holds a journal, `llmc quantize --resume`), a stopped run keeps its staging folder and says how to continue it or
remove it; a run killed outright leaves it behind the same way."""
import errno
import hashlib
import json
import os
import secrets
import shutil
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from llmc.artifact.compressed_tensors import compressed_tensors_tensors
from llmc.core.errors import LlmcError
from llmc.core.staging import OutputTaken, check_output, move_into_place, unique_sibling
from llmc.quant.qtypes import QuantizedWeight

PackLinear = Callable[[str, QuantizedWeight], dict[str, torch.Tensor]]
MANIFEST = "llmc.json"
RECIPE = "recipe.yaml"  # the recipe that made the artifact
INDEX = "model.safetensors.index.json"
JOURNAL = "resume.json"  # the finished work of a run in its staging folder: not part of the artifact
KEPT = "kept"  # in place of the pid in a staging folder's name: kept by a run that stopped, no process uses it
# the phases a journal records after the layers, in order, as a message names them (artifact/resume.py)
WRITTEN, EVALS, DRAFT, COMPLETE = "written", "evals", "draft", "complete"
PHASE_WORDS = {WRITTEN: "the other files", EVALS: "the evals", DRAFT: "a draft stage begun", COMPLETE: "the whole artifact"}
CONTINUE_HINT = "rerun the same command with --resume to continue from there, or with --discard-partial to remove it"


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def staging_prefix(output: Path) -> str:
    return f".{output.name}.partial-"


def abandoned(folder: Path, output: Path) -> bool:
    """Whether no process works in this staging folder: kept by a run that stopped, or its process is gone."""
    owner = folder.name.removeprefix(staging_prefix(output)).split("-")[0]
    return owner == KEPT or (owner.isdigit() and not process_alive(int(owner)))


def killed_staging(output: Path) -> list[Path]:
    """The staging folders for output that no process works in any more: left behind by runs killed outright
    (SIGKILL, the OOM killer, a lost machine), or kept by runs that stopped after finishing some of their work."""
    return [folder for folder in output.parent.glob(f"{staging_prefix(output)}*") if abandoned(folder, output)]


def holds_finished_work(staging: Path) -> bool:
    return (staging / JOURNAL).is_file()


def finished_work(staging: Path) -> str:
    """What a staging folder's journal says is done, in words."""
    state = json.loads((staging / JOURNAL).read_text())
    phases = "".join(f", {PHASE_WORDS[phase]}" for phase in state.get("phases", {}))
    return f"{len(state['finished'])} finished layer(s){phases}"


def kept_staging(output: Path) -> list[Path]:
    """The abandoned staging folders for output that hold finished work: only --resume or --discard-partial touch them."""
    return [folder for folder in killed_staging(output) if holds_finished_work(folder)]


def remove_stale_staging(output: Path) -> None:
    """Remove the abandoned staging folders that hold no finished work, saying so."""
    for folder in killed_staging(output):
        if not holds_finished_work(folder):
            shutil.rmtree(folder, ignore_errors=True)
            print(f"removed {folder}, left behind by a run that stopped before it finished anything", file=sys.stderr)


def discard_kept_staging(output: Path) -> None:
    """--discard-partial: remove the finished work earlier runs of output kept, saying so."""
    for folder in kept_staging(output):
        shutil.rmtree(folder)
        print(f"removed {folder} (--discard-partial)", file=sys.stderr)


def refuse_kept_staging(output: Path) -> None:
    """A fresh run leaves an earlier run's finished work alone, and says how to continue it or remove it."""
    kept = kept_staging(output)
    if kept:
        raise LlmcError(f"{kept[0]} holds the {finished_work(kept[0])} of an earlier run of {output} that "
                        f"stopped before the end: {CONTINUE_HINT} and start again")


def settle_kept_staging(output: Path, resume: bool, discard: bool) -> None:
    """Before a run: the work earlier runs of output kept is continued (--resume), removed (--discard-partial), or, when
    neither was asked for, left alone and the run refused."""
    if resume and discard:
        raise LlmcError("--resume continues the work an earlier run kept and --discard-partial removes it: pass one of them")
    if discard:
        discard_kept_staging(output)
    elif not resume:
        refuse_kept_staging(output)


def staging_folder(output: Path) -> Path:
    return output.with_name(f"{staging_prefix(output)}{os.getpid()}-{secrets.token_hex(4)}")


def kept(staging: Path, output: Path) -> Path:
    """The staging folder of a stopped run renamed as no process's, so that --resume finds it at once."""
    kept_as = output.with_name(f"{staging_prefix(output)}{KEPT}-{secrets.token_hex(4)}")
    staging.rename(kept_as)
    return kept_as


def stopped_with_work_kept(error: BaseException, staging: Path, output: Path) -> BaseException:
    """What a run that stopped after finishing some work raises: its error with where the work is and how to go on.
    A full disk and other OS errors become one LlmcError; an unforeseen error keeps its traceback."""
    kept_as = kept(staging, output)
    note = f"the {finished_work(kept_as)} are kept in {kept_as} with their journal: {CONTINUE_HINT}"
    if isinstance(error, OSError):
        return LlmcError(f"{os_error_text(error)}\n{note}")
    if isinstance(error, LlmcError):
        error.args = (f"{error}\n{note}",)
        return error
    print(f"{'interrupted' if isinstance(error, KeyboardInterrupt) else type(error).__name__}: {note}", file=sys.stderr)
    return error


def os_error_text(error: OSError) -> str:
    where = f" {error.filename}" if error.filename else ""
    if error.errno == errno.ENOSPC:
        return f"no space left on the device writing{where}"
    return f"{error.strerror or error}{where and ':' + where}"


@contextmanager
def staged_folder(output: Path, overwrite: bool = False, adopt: Path | None = None):
    """adopt: an abandoned staging folder to continue in (`--resume`), renamed to this process's. The journal is
    removed just before the finished folder is moved into place."""
    check_output(output, overwrite)
    staging = staging_folder(output)
    if adopt is not None:
        adopt.rename(staging)
    remove_stale_staging(output)
    if adopt is None:
        staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException as error:
        if not holds_finished_work(staging):
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(error, OSError):
                raise LlmcError(os_error_text(error)) from error
            raise
        raised = stopped_with_work_kept(error, staging, output)
        if raised is error:
            raise
        raise raised from error
    publish(staging, output, overwrite)


def publish(staging: Path, output: Path, overwrite: bool) -> None:
    """The finished staging folder moved into place, without its journal; an output that appeared meanwhile is
    replaced only with --overwrite, else the finished artifact is kept, journal and all, for --resume --overwrite."""
    journal = unique_sibling(output, "journal")
    if not (output.exists() or output.is_symlink()) or overwrite:
        if holds_finished_work(staging):
            (staging / JOURNAL).rename(journal)
        try:
            move_into_place(staging, output, overwrite)
        except BaseException as error:
            if journal.is_file():
                journal.rename(staging / JOURNAL)
            if not isinstance(error, OutputTaken):
                raise
        else:
            journal.unlink(missing_ok=True)
            return
    kept_as = kept(staging, output)
    raise LlmcError(f"{output} appeared while this run worked; the finished artifact is kept in {kept_as}: move it where "
                    f"you want it, or rerun the same command with --resume --overwrite to replace {output}")


@contextmanager
def staged_copy(folder: Path, rewritten: set[str], dropped: set[str]):
    """A staging copy of a finished folder to change, swapped in for it when the block ends; removed on any error
    (the folder itself is never touched). The files in `rewritten` are real copies, those under the folders in
    `dropped` are left out, the others are hard links (no space taken). Refused when the folder changed meanwhile."""
    folder = folder.resolve()  # a link to the artifact stays a link to it
    remove_stale_staging(folder)
    staging = staging_folder(folder)
    manifest = (folder / MANIFEST).read_bytes()
    try:
        copy_linked(folder, staging, rewritten, dropped)
        yield staging
        if (folder / MANIFEST).read_bytes() != manifest:
            raise LlmcError(f"{folder} changed while this run worked on a copy of it; it is left as it is")
        move_into_place(staging, folder, replace=True)
    except OSError as error:
        raise LlmcError(os_error_text(error)) from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def copy_linked(source: Path, target: Path, rewritten: set[str], dropped: set[str]) -> None:
    for path in sorted(source.rglob("*")):
        name = path.relative_to(source)
        if name.parts[0] in dropped or path.is_dir():
            continue
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        if str(name) in rewritten:
            shutil.copy2(path, target / name)
        else:
            try:
                os.link(path, target / name)
            except OSError:  # a file system without hard links
                shutil.copy2(path, target / name)


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
                # NVFP4's global scales stay float32, as compressed-tensors stores them
                tensors[full_name] = param if name.endswith("_global_scale") else param.to(self.dtype)
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


def sha256_of_files(folder: Path, skip: set[str] = frozenset()) -> dict[str, str]:
    """Every file of the artifact but the manifest and those in skip, with its sha256 (a staging folder's journal is
    not the artifact's)."""
    names = (str(path.relative_to(folder)) for path in sorted(folder.rglob("*"))
             if path.is_file() and path.name not in (MANIFEST, JOURNAL))
    return {name: sha256_of_file(folder / name) for name in names if name not in skip}


def write_manifest(folder: Path, manifest: dict) -> None:
    """Written beside and renamed: the manifest is never half written, and a hard link to an earlier one is replaced,
    not changed."""
    manifest = {**manifest, "files": sha256_of_files(folder)}
    partial = unique_sibling(folder / MANIFEST)
    partial.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(partial, folder / MANIFEST)
