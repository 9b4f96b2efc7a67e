"""`llmc quantize --resume`: a run killed outright mid-way continues after its last intact layer, and the artifact
equals an uninterrupted run's."""
import json
import signal
import subprocess
import sys

import pytest
import torch
from helpers import RESUMABLE_STAGES, RTN_W4A16, artifact_tensors, write_recipe

from llmc.artifact.resume import JOURNAL
from llmc.artifact.writer import MANIFEST
from llmc.core.errors import LlmcError
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe

MEASURED = ("created", "timings", "memory")  # what differs between any two runs


def killed_after_two_layers(recipe) -> None:
    """Runs the recipe in a process that is SIGKILLed while writing the third layer's shard, half written."""
    script = f"""
import os, pathlib, signal
import llmc.artifact.writer as writer
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
save_file, calls = writer.save_file, []
def dying_save(tensors, path, metadata=None):
    calls.append(path)
    if len(calls) == 3:
        pathlib.Path(path).write_bytes(b"half a shard")
        os.kill(os.getpid(), signal.SIGKILL)
    save_file(tensors, path, metadata=metadata)
writer.save_file = dying_save
run_quantize(load_recipe(pathlib.Path({str(recipe)!r})))
"""
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr


def manifest_without_measurements(artifact) -> dict:
    manifest = json.loads((artifact / MANIFEST).read_text())
    for layer in manifest["layers"]:
        del layer["seconds"]
    return {name: value for name, value in manifest.items() if name not in MEASURED}


@pytest.mark.parametrize("stage", list(RESUMABLE_STAGES))
def test_a_run_killed_mid_way_resumes_to_the_uninterrupted_artifact(tmp_path, four_layers, calib_file, stage, capfd):
    recipe = write_recipe(tmp_path / "r.yaml", four_layers, tmp_path / "out", RESUMABLE_STAGES[stage], calib_file)
    reference = run_quantize(load_recipe(recipe)).rename(tmp_path / "reference")
    killed_after_two_layers(recipe)
    (staging,) = tmp_path.glob(".out.partial-*")
    journal = json.loads((staging / JOURNAL).read_text())
    assert [layer["report"]["index"] for layer in journal["finished"]] == [0, 1]
    second_shard = staging / journal["finished"][1]["shard"]
    second_shard.write_bytes(second_shard.read_bytes()[:-1] + b"\0")  # damaged after it was recorded: redone
    capfd.readouterr()

    artifact = run_quantize(load_recipe(recipe), resume=True)
    assert "1 finished layer(s) verified by sha256" in capfd.readouterr().err
    assert not staging.exists() and not (artifact / JOURNAL).exists()
    expected, resumed = artifact_tensors(reference), artifact_tensors(artifact)
    assert expected.keys() == resumed.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, resumed[name]), name
    assert manifest_without_measurements(artifact) == manifest_without_measurements(reference)


def test_resume_refuses_another_recipes_staging_and_leaves_it(tmp_path, four_layers, calib_file):
    recipe = write_recipe(tmp_path / "r.yaml", four_layers, tmp_path / "out", RESUMABLE_STAGES["gptq-kv"], calib_file)
    killed_after_two_layers(recipe)
    (staging,) = tmp_path.glob(".out.partial-*")
    with pytest.raises(LlmcError, match="--resume: .* was written by a run with another recipe"):
        run_quantize(load_recipe(recipe, ["stages.0.weights.group_size=16"]), resume=True)
    assert staging.is_dir() and (staging / JOURNAL).is_file()


def test_resume_with_nothing_to_resume_starts_from_the_first_layer(tmp_path, four_layers, capfd):
    recipe = write_recipe(tmp_path / "r.yaml", four_layers, tmp_path / "out", RTN_W4A16)
    assert run_quantize(load_recipe(recipe), resume=True).is_dir()
    assert "left anything to resume; starting from the first layer" in capfd.readouterr().err
    assert not list(tmp_path.glob(".out.partial-*"))
