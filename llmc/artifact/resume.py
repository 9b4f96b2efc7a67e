"""`llmc quantize --resume`: a run that stopped (Ctrl-C, an error, a full disk) or was killed outright (SIGKILL, the
OOM killer, a lost machine) after finishing a layer leaves its staging folder behind with a journal of its finished
work: the layers whose shards it wrote, each with the shard's sha256, then the phases after them (the other files
written, the evals with their summary, the draft started, the artifact complete). A resumed run adopts that folder,
keeps the longest run of layers whose shards still hash as recorded and the phases whose files still do, and carries
on from there: after the next layer (the calibration activations are recomputed by the finished layers' forwards on
the weights as written), or with the evals, or with the draft (its distillation reads back the answers it cached)."""
import hashlib
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from llmc.artifact.reader import DRAFT_DIR, Layout, dense_tensors
from llmc.artifact.writer import (
    COMPLETE,
    EVALS,
    JOURNAL,
    MANIFEST,
    PHASE_WORDS,
    WRITTEN,
    ShardWriter,
    killed_staging,
    sha256_of_file,
    sha256_of_files,
)
from llmc.calib.driver import EmitLayer, LayerReport, Resumption
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.core.errors import LlmcError
from llmc.quant.layer import COMPUTE_DTYPE
from llmc.quant.qtypes import QuantizedWeight

REPORT_DIR = "report"
# the phases after the layers record: WRITTEN the files besides the layers' shards, with their sha256, the
# quantization's time and memory; EVALS the evals' summary (the report is in report/) and their time; DRAFT that the
# draft stage started (a resumed run starts it again); COMPLETE that the manifest and the draft are written (a resumed
# run only moves the artifact into place)


@dataclass
class FinishedLayer:
    report: LayerReport
    shard: str  # the layer's shard, by file name
    sha256: str
    tensor_bytes: dict[str, int]  # the shard's tensors with their sizes: the index over the shards is rebuilt from them


@dataclass
class Journal:
    """The finished work of the run in `staging`, saved after each layer and phase (written beside and renamed: a kill
    mid-save leaves the previous journal). Not part of the artifact: the staged writer removes it before the rename."""

    staging: Path
    fingerprint: str
    finished: list[FinishedLayer] = field(default_factory=list)
    phases: dict[str, dict] = field(default_factory=dict)

    def record(self, report: LayerReport, shard: str, tensor_bytes: dict[str, int]) -> None:
        self.finished.append(FinishedLayer(report, shard, sha256_of_file(self.staging / shard), tensor_bytes))
        self.save()

    def record_phase(self, phase: str, details: dict) -> dict:
        self.phases[phase] = details
        self.save()
        return details

    def save(self) -> None:
        state = {"fingerprint": self.fingerprint, "finished": [asdict(layer) for layer in self.finished], "phases": self.phases}
        partial = self.staging / f".{JOURNAL}.partial"
        partial.write_text(json.dumps(state, indent=1))
        os.replace(partial, self.staging / JOURNAL)

    def discard(self) -> None:
        """The work is refused (a failed gate): nothing is left to resume, and the staged writer removes the folder."""
        (self.staging / JOURNAL).unlink(missing_ok=True)

    def record_written(self, timings: dict) -> dict:
        """Every file besides the layers' shards is written: recorded with their sha256."""
        shards = {layer.shard for layer in self.finished}
        return self.record_phase(WRITTEN, {"files": sha256_of_files(self.staging, skip=shards)} | timings)


def run_fingerprint(recipe_fields: dict, calibration_sha256: str | None, llmc_version: str) -> str:
    """What decides the layers' tensors: the recipe but its evals, draft and output, the calibration tokens, llmc."""
    kept = {name: value for name, value in recipe_fields.items() if name not in ("eval", "draft", "output")}
    text = json.dumps([kept, calibration_sha256, llmc_version], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def resumable_staging(output: Path, fingerprint: str) -> Path | None:
    """The newest staging folder for output with a journal, kept by a run that stopped or left by a process that no
    longer runs; refused (and left as it is) when another recipe, calibration set or llmc version wrote it."""
    candidates = [folder for folder in killed_staging(output) if (folder / JOURNAL).is_file()]
    staging = max(candidates, key=lambda folder: (folder / JOURNAL).stat().st_mtime, default=None)
    if staging is None:
        print(f"--resume: no stopped or killed run of {output} left anything to resume; starting from the first layer", file=sys.stderr)
    elif json.loads((staging / JOURNAL).read_text())["fingerprint"] != fingerprint:
        raise LlmcError(f"--resume: {staging} was written by a run with another recipe, calibration set or llmc "
                        "version; rerun with --discard-partial instead of --resume to remove it and start again")
    return staging


def resumed_journal(staging: Path, fingerprint: str) -> Journal:
    """The journal of an adopted staging folder, cut to the layers whose shards still hash as recorded and the phases
    after them whose files are still there as recorded; every other file goes."""
    state = json.loads((staging / JOURNAL).read_text())
    journal = Journal(staging, fingerprint)
    for layer in state["finished"]:
        finished = FinishedLayer(LayerReport(**layer["report"]), layer["shard"], layer["sha256"], layer["tensor_bytes"])
        shard = staging / finished.shard
        if not shard.is_file() or sha256_of_file(shard) != finished.sha256:
            break
        journal.finished.append(finished)
    if len(journal.finished) == len(state["finished"]):
        journal.phases = intact_phases(staging, state.get("phases", {}))
    keep_only(staging, {layer.shard for layer in journal.finished} | {JOURNAL} | phase_files(journal.phases))
    journal.save()
    phases = "".join(f", {PHASE_WORDS[phase]}" for phase in journal.phases)
    print(f"resuming in {staging}: {len(journal.finished)} finished layer(s) verified by sha256{phases}", file=sys.stderr)
    return journal


def intact_phases(staging: Path, phases: dict[str, dict]) -> dict[str, dict]:
    """The recorded phases up to the first whose files are not as it left them. A draft stage that started is done
    again, so it and what follows go."""
    kept: dict[str, dict] = {}
    if WRITTEN not in phases or not files_intact(staging, phases[WRITTEN]["files"]):
        return kept
    kept[WRITTEN] = phases[WRITTEN]
    if EVALS in phases:
        kept[EVALS] = phases[EVALS]
    if EVALS in kept and COMPLETE in phases and manifest_intact(staging):
        kept[COMPLETE] = phases[COMPLETE]
    return kept


def files_intact(staging: Path, files: dict[str, str]) -> bool:
    return all((staging / name).is_file() and sha256_of_file(staging / name) == digest for name, digest in files.items())


def manifest_intact(staging: Path) -> bool:
    manifest = staging / MANIFEST
    return manifest.is_file() and json.loads(manifest.read_text()).get("files") == sha256_of_files(staging)


def phase_files(phases: dict[str, dict]) -> set[str]:
    """The top-level names the kept phases wrote."""
    names = {name.split("/")[0] for name in phases.get(WRITTEN, {}).get("files", {})}
    if EVALS in phases:
        names.add(REPORT_DIR)
    if COMPLETE in phases:
        names |= {MANIFEST, DRAFT_DIR}
    return names


def keep_only(staging: Path, names: set[str]) -> None:
    for path in staging.iterdir():
        if path.name in names:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def resumption(journal: Journal, layout: Layout) -> Resumption | None:
    """What the layer-by-layer driver needs to carry on after the journal's layers; None when there are none."""
    if not journal.finished:
        return None
    reader = CheckpointReader(journal.staging)  # the finished layers' shards, before any other is written

    def written_state(prefix: str) -> dict[str, torch.Tensor]:
        return dense_tensors(reader, layout, COMPUTE_DTYPE, f"{prefix}.")

    return Resumption([layer.report for layer in journal.finished], written_state)


def journaled(writer: ShardWriter, journal: Journal) -> EmitLayer:
    """Each layer written to its shard, then recorded in the journal."""
    def emit(prefix: str, layer: nn.Module, quantized: dict[str, QuantizedWeight], report: LayerReport) -> None:
        writer.write_layer(prefix, layer, quantized)
        journal.record(report, *writer.last_written)

    return emit
