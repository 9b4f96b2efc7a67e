"""No fault loses finished work: a full disk, Ctrl-C or an error after a finished layer keeps the staging folder and
its journal (`--resume` continues, `--discard-partial` removes it), the journal covers the evals and the draft stage,
an output is replaced only with --overwrite, and `train-draft` works on a copy of the artifact."""
import errno
import json
import os

import pytest
import torch
from click.testing import CliRunner
from helpers import RESUMABLE_STAGES, RTN_W4A16, artifact_tensors, write_recipe

import llmc.artifact.writer as writer
import llmc.draft.build as build
import llmc.pipeline.quantize as pipeline
from llmc.artifact.resume import JOURNAL
from llmc.artifact.writer import MANIFEST, staged_folder, write_manifest
from llmc.cli import cli, main
from llmc.core.errors import LlmcError
from llmc.draft.data import distill_cache_path
from llmc.pipeline.recipe import load_recipe


def llmc_main(monkeypatch, *args: str) -> int:
    """`llmc ARGS` in this process, through the console script's entry point: its exit status."""
    monkeypatch.setattr("sys.argv", ["llmc", *args])
    try:
        main()
    except SystemExit as exit:
        return exit.code
    return 0


def kept_staging(folder) -> tuple:
    return tuple(folder.glob(".out.partial-*"))


def finished_indices(staging) -> list[int]:
    return [layer["report"]["index"] for layer in json.loads((staging / JOURNAL).read_text())["finished"]]


def test_a_full_disk_loses_no_finished_layer_and_resume_completes_the_artifact(tmp_path, four_layers, calib_file,
                                                                               monkeypatch, capfd):
    recipe = write_recipe(tmp_path / "r.yaml", four_layers, tmp_path / "out", RESUMABLE_STAGES["gptq-kv"], calib_file)
    reference = pipeline.run_quantize(load_recipe(recipe)).rename(tmp_path / "reference")
    save_file, calls = writer.save_file, []

    def full_disk_at_the_third_layer(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(writer, "save_file", full_disk_at_the_third_layer)
    capfd.readouterr()
    assert llmc_main(monkeypatch, "quantize", str(recipe)) == 2
    err = capfd.readouterr().err
    (staging,) = kept_staging(tmp_path)
    assert "error: no space left on the device writing" in err and "Traceback" not in err
    assert f"the 2 finished layer(s) are kept in {staging} with their journal" in err and "--resume" in err and "--discard-partial" in err
    assert finished_indices(staging) == [0, 1] and not (tmp_path / "out").exists()

    monkeypatch.setattr(writer, "save_file", save_file)
    assert llmc_main(monkeypatch, "quantize", str(recipe)) == 2  # a fresh run leaves the kept work alone
    err = capfd.readouterr().err
    assert f"{staging} holds the 2 finished layer(s) of an earlier run" in err and "--resume" in err and "--discard-partial" in err
    assert finished_indices(staging) == [0, 1]

    assert llmc_main(monkeypatch, "quantize", str(recipe), "--resume") == 0
    assert "2 finished layer(s) verified by sha256" in capfd.readouterr().err
    artifact = tmp_path / "out"
    assert not kept_staging(tmp_path) and not (artifact / JOURNAL).exists()
    expected, resumed = artifact_tensors(reference), artifact_tensors(artifact)
    assert expected.keys() == resumed.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, resumed[name]), name


def test_ctrl_c_after_a_layer_keeps_the_work_until_discard_partial(tmp_path, four_layers, monkeypatch, capfd):
    recipe = write_recipe(tmp_path / "r.yaml", four_layers, tmp_path / "out", RTN_W4A16)

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "run_recipe_evals", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_quantize(load_recipe(recipe))
    (staging,) = kept_staging(tmp_path)
    assert f"interrupted: the 4 finished layer(s), the other files are kept in {staging}" in capfd.readouterr().err
    with pytest.raises(LlmcError, match="holds the 4 finished layer.* --resume .* --discard-partial to remove it"):
        pipeline.run_quantize(load_recipe(recipe))
    with pytest.raises(LlmcError, match="pass one of them"):
        pipeline.run_quantize(load_recipe(recipe), resume=True, discard_partial=True)
    monkeypatch.undo()
    assert pipeline.run_quantize(load_recipe(recipe), discard_partial=True).is_dir()
    assert f"removed {staging} (--discard-partial)" in capfd.readouterr().err and not kept_staging(tmp_path)


@pytest.fixture
def counted(monkeypatch):
    """Calls to the layer-by-layer quantization and the evals (which answer {"fake": 1}), by name."""
    calls = {"layers": 0, "evals": 0}
    quantize_layerwise = pipeline.quantize_layerwise

    def layers(*args, **kwargs):
        calls["layers"] += 1
        return quantize_layerwise(*args, **kwargs)

    def evals(*args, **kwargs):
        calls["evals"] += 1
        if calls.get("stop_in_evals"):
            raise KeyboardInterrupt
        return {"fake": 1}

    monkeypatch.setattr(pipeline, "quantize_layerwise", layers)
    monkeypatch.setattr(pipeline, "run_recipe_evals", evals)
    return calls


def test_resume_after_a_stop_in_the_evals_runs_the_evals_only(tmp_path, four_layers, counted):
    recipe = write_recipe(tmp_path / "r.yaml", four_layers, tmp_path / "out", RTN_W4A16)
    counted["stop_in_evals"] = True
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_quantize(load_recipe(recipe))
    counted["stop_in_evals"] = False
    artifact = pipeline.run_quantize(load_recipe(recipe), resume=True)
    assert counted == {"layers": 1, "evals": 2, "stop_in_evals": False}
    manifest = json.loads((artifact / MANIFEST).read_text())
    assert manifest["eval"] == {"fake": 1} and [layer["index"] for layer in manifest["layers"]] == [0, 1, 2, 3]
    assert not kept_staging(tmp_path) and JOURNAL not in manifest["files"] and not (artifact / JOURNAL).exists()


def test_resume_after_a_stop_in_the_draft_stage_restarts_the_draft_only(tmp_path, four_layers, calib_file, counted,
                                                                        monkeypatch):
    recipe = write_recipe(tmp_path / "r.yaml", four_layers, tmp_path / "out", RTN_W4A16)
    recipe.write_text(recipe.read_text() + f"draft:\n  method: medusa\n  prompts: [{calib_file}]\n")
    drafts = []

    def train_draft(artifact, config, device):
        folder = artifact / "draft"
        folder.mkdir(exist_ok=True)
        drafts.append(sorted(path.name for path in folder.iterdir()))
        if len(drafts) == 1:
            (folder / "checkpoint.safetensors").write_text("a stage cut short")
            raise KeyboardInterrupt
        (folder / "config.json").write_text("{}")
        write_manifest(artifact, json.loads((artifact / MANIFEST).read_text()) | {"draft": {}})
        return folder

    monkeypatch.setattr(build, "train_draft", train_draft)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_quantize(load_recipe(recipe))
    (staging,) = kept_staging(tmp_path)
    assert list(json.loads((staging / JOURNAL).read_text())["phases"]) == ["written", "evals", "draft"]
    artifact = pipeline.run_quantize(load_recipe(recipe), resume=True)
    assert counted == {"layers": 1, "evals": 1} and drafts == [[], []]  # the draft stage alone, from the start
    manifest = json.loads((artifact / MANIFEST).read_text())
    assert manifest["eval"] == {"fake": 1} and manifest["draft"] == {} and "draft/config.json" in manifest["files"]
    assert not kept_staging(tmp_path) and not (artifact / JOURNAL).exists()


def staged_with_a_journal(output, overwrite: bool, meanwhile) -> None:
    with staged_folder(output, overwrite) as staging:
        (staging / "weights").write_text("new")
        (staging / JOURNAL).write_text(json.dumps({"fingerprint": "", "finished": [], "phases": {"complete": {}}}))
        meanwhile()


def test_an_output_that_appears_meanwhile_is_replaced_only_with_overwrite(tmp_path):
    output = tmp_path / "out"

    def another_run_writes_it():
        output.mkdir()
        (output / "weights").write_text("theirs")

    with pytest.raises(LlmcError, match=f"{output} appeared while this run worked; the finished artifact is kept in .*--overwrite"):
        staged_with_a_journal(output, False, another_run_writes_it)
    (staging,) = kept_staging(tmp_path)
    assert (output / "weights").read_text() == "theirs" and (staging / "weights").read_text() == "new"
    assert (staging / JOURNAL).is_file()  # --resume --overwrite finishes it

    staged_with_a_journal(output, True, lambda: None)
    assert (output / "weights").read_text() == "new" and not (output / JOURNAL).exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == [staging.name, "out"]  # the replaced one is gone


def fake_artifact(folder, weights: str, **manifest) -> None:
    folder.mkdir()
    (folder / "model.safetensors").write_text(weights)
    (folder / "draft").mkdir()
    (folder / "draft" / "heads.safetensors").write_text("old heads")
    write_manifest(folder, manifest)


def test_train_draft_works_on_a_copy_that_replaces_the_artifact_when_done(tmp_path, monkeypatch):
    artifact = tmp_path / "art"
    fake_artifact(artifact, "weights", model="m")
    before = (artifact / MANIFEST).read_text()
    seen = []

    def train_draft(staging, config, device):
        seen.append(staging)
        original, copy = artifact / "model.safetensors", staging / "model.safetensors"
        assert os.path.samefile(original, copy) and not os.path.samefile(artifact / MANIFEST, staging / MANIFEST)
        assert not (staging / "draft").exists()
        (staging / "draft").mkdir()
        (staging / "draft" / "config.json").write_text("{}")
        write_manifest(staging, json.loads((staging / MANIFEST).read_text()) | {"draft": {"method": "medusa"}})
        if len(seen) == 1:
            raise KeyboardInterrupt
        return staging / "draft"

    monkeypatch.setattr(build, "train_draft", train_draft)
    stopped = CliRunner().invoke(cli, ["train-draft", str(artifact), "--device", "cpu"])
    assert isinstance(stopped.exception, KeyboardInterrupt) or stopped.exit_code != 0
    assert (artifact / MANIFEST).read_text() == before and (artifact / "draft" / "heads.safetensors").is_file()
    assert not seen[0].exists() and sorted(path.name for path in tmp_path.iterdir()) == ["art"]

    run = CliRunner().invoke(cli, ["train-draft", str(artifact), "--device", "cpu"])
    assert run.exit_code == 0, run.output
    manifest = json.loads((artifact / MANIFEST).read_text())
    assert manifest["draft"] == {"method": "medusa"} and sorted(manifest["files"]) == ["draft/config.json", "model.safetensors"]
    assert (artifact / "model.safetensors").read_text() == "weights" and sorted(path.name for path in tmp_path.iterdir()) == ["art"]


def test_the_distillation_cache_key_is_the_weights_prompts_and_settings(tmp_path, calib_file, monkeypatch):
    monkeypatch.setenv("LLMC_HOME", str(tmp_path / "home"))
    fake_artifact(tmp_path / "a", "weights", created="2024-01-01T00:00:00", timings={"quantize_s": 1.0})
    fake_artifact(tmp_path / "b", "weights", created="2025-06-01T12:00:00", timings={"quantize_s": 7.5})
    (tmp_path / "b" / "report").mkdir()
    (tmp_path / "b" / "report" / "report.md").write_text("evals")
    write_manifest(tmp_path / "b", json.loads((tmp_path / "b" / MANIFEST).read_text()))
    fake_artifact(tmp_path / "c", "other weights", created="2024-01-01T00:00:00", timings={"quantize_s": 1.0})
    key = {name: distill_cache_path(tmp_path / name, calib_file, 6, 24) for name in "abc"}
    assert key["a"] == key["b"] != key["c"]
    assert distill_cache_path(tmp_path / "a", calib_file, 6, 32) != key["a"]  # the settings too
