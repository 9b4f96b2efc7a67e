"""`llmc quantize --resume`: a run killed outright (SIGKILL, the OOM killer, a lost machine) leaves its staging
folder behind with a journal of the layers whose shards it finished, each with the shard's sha256. A resumed run
adopts that folder, keeps the longest run of layers whose shards still hash as recorded, and carries on from the
next layer; the calibration activations are recomputed by the finished layers' forwards on the weights as written."""
import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from llmc.artifact.reader import Layout, dense_tensors
from llmc.artifact.writer import ShardWriter, killed_staging, sha256_of_file
from llmc.calib.driver import EmitLayer, LayerReport, Resumption
from llmc.errors import LlmcError
from llmc.models.checkpoint import CheckpointReader
from llmc.quant.layer import COMPUTE_DTYPE
from llmc.quant.qtypes import QuantizedWeight

JOURNAL = "resume.json"


@dataclass
class FinishedLayer:
    report: LayerReport
    shard: str  # the layer's shard, by file name
    sha256: str
    tensor_bytes: dict[str, int]  # the shard's tensors with their sizes: the index over the shards is rebuilt from them


@dataclass
class Journal:
    """The finished layers of the run in `staging`, saved after each one (written beside and renamed: a kill
    mid-save leaves the previous journal)."""

    staging: Path
    fingerprint: str
    finished: list[FinishedLayer] = field(default_factory=list)

    def record(self, report: LayerReport, shard: str, tensor_bytes: dict[str, int]) -> None:
        self.finished.append(FinishedLayer(report, shard, sha256_of_file(self.staging / shard), tensor_bytes))
        state = {"fingerprint": self.fingerprint, "finished": [asdict(layer) for layer in self.finished]}
        partial = self.staging / f".{JOURNAL}.partial"
        partial.write_text(json.dumps(state, indent=1))
        os.replace(partial, self.staging / JOURNAL)

    def close(self) -> None:
        """Every layer is written: the journal is not part of the artifact."""
        (self.staging / JOURNAL).unlink(missing_ok=True)


def run_fingerprint(recipe_fields: dict, calibration_sha256: str | None, llmc_version: str) -> str:
    """What decides the layers' tensors: the recipe but its evals, draft and output, the calibration tokens, llmc."""
    kept = {name: value for name, value in recipe_fields.items() if name not in ("eval", "draft", "output")}
    text = json.dumps([kept, calibration_sha256, llmc_version], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def resumable_staging(output: Path, fingerprint: str) -> Path | None:
    """The newest staging folder for output with a journal, left by a process that no longer runs; refused (and
    left as it is) when another recipe, calibration set or llmc version wrote it."""
    candidates = [folder for folder in killed_staging(output) if (folder / JOURNAL).is_file()]
    staging = max(candidates, key=lambda folder: (folder / JOURNAL).stat().st_mtime, default=None)
    if staging is None:
        print(f"--resume: no killed run of {output} left anything to resume; starting from the first layer", file=sys.stderr)
    elif json.loads((staging / JOURNAL).read_text())["fingerprint"] != fingerprint:
        raise LlmcError(f"--resume: {staging} was written by a run with another recipe, calibration set or llmc "
                        "version; rerun without --resume to start again (that removes it)")
    return staging


def resumed_journal(staging: Path, fingerprint: str) -> Journal:
    """The journal of an adopted staging folder, cut to the layers whose shards still hash as recorded; the files
    past them go."""
    journal = Journal(staging, fingerprint)
    for layer in json.loads((staging / JOURNAL).read_text())["finished"]:
        finished = FinishedLayer(LayerReport(**layer["report"]), layer["shard"], layer["sha256"], layer["tensor_bytes"])
        shard = staging / finished.shard
        if not shard.is_file() or sha256_of_file(shard) != finished.sha256:
            break
        journal.finished.append(finished)
    kept = {layer.shard for layer in journal.finished} | {JOURNAL}
    for path in staging.iterdir():
        if path.name not in kept:
            path.unlink()
    print(f"resuming in {staging}: {len(journal.finished)} finished layer(s) verified by sha256", file=sys.stderr)
    return journal


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
