"""`llmc tune` end to end on a constructed case: a tiny model with one Linear that 4-bit groups ruin (an outlier in
every group) and one whose output hardly counts (weights a thousandth of the others'). The search must give the
first 8 bits, the second 4, and publish an artifact whose recipe reproduces it."""
import hashlib
import json

import pytest
import torch
from helpers import artifact_tensors, build_tiny_model, llmc_in_process
from safetensors.torch import load_file, save_file

from llmc.tune.config import load_tune

SENSITIVE, INSENSITIVE = "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj"


@pytest.fixture(scope="module")
def constructed(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("constructed"), num_layers=2)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(0)
    sensitive = torch.randn(tensors[f"{SENSITIVE}.weight"].shape, generator=generator) * 0.5
    sensitive[:, ::32] = 10.0  # each 32-wide group's range set by one outlier: 4-bit steps of 1.4 round the rest to 0
    tensors[f"{SENSITIVE}.weight"] = sensitive
    tensors[f"{INSENSITIVE}.weight"] = tensors[f"{INSENSITIVE}.weight"] * 1e-3  # adds next to nothing to the residual stream
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 50  # peaked next-token distributions: KL sees the damage
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def business_set(path):
    items = [{"id": f"q{n}", "prompt": f"Say {word}", "reference": word, "metric": "contains", "max_tokens": 4, "tags": ["t"]}
             for n, word in enumerate(["fox", "dog", "time", "memory", "quick", "brown"])]
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def tune_file(tmp_path, model, calib_file, extra: str = "", gate: str = "{max_kl: 0.05}"):
    path = tmp_path / "tune.yaml"
    path.write_text(f"""model: {model}
output: {tmp_path / "out"}
calibration: {{dataset: {calib_file}, num_samples: 4, seq_len: 32}}
candidates: [keep, W8A16, {{scheme: W4A16, weights: {{group_size: 32}}}}]
eval:
  business: {{dataset: {business_set(tmp_path / "set.jsonl")}}}
  gate: {gate}
sensitivity_samples: 4
max_evaluations: 8
{extra}""")
    return path


def test_the_measured_sensitivities_and_the_solve_give_the_known_best_assignment(tmp_path, constructed, calib_file):
    from transformers import AutoConfig, AutoTokenizer

    from llmc.calib.data import load_calibration
    from llmc.calib.driver import SourceModel, build_skeleton
    from llmc.checkpoints.checkpoint_reader import CheckpointReader
    from llmc.checkpoints.families import family_for
    from llmc.tune.config import candidate_formats
    from llmc.tune.sensitivity import Objective, measure_units
    from llmc.tune.solve import frontier

    config = load_tune(tune_file(tmp_path, constructed, calib_file))
    hf_config = AutoConfig.from_pretrained(constructed)
    model = SourceModel(CheckpointReader(constructed), build_skeleton(hf_config), hf_config, family_for(hf_config))
    calibration = load_calibration(config.calibration, AutoTokenizer.from_pretrained(constructed))
    units = measure_units(model, calibration, candidate_formats(config), Objective("smallest", None, torch.float32),
                          torch.device("cpu"), torch.float32)
    by_name = {unit.names[0]: unit for unit in units}
    sensitive, insensitive = by_name[SENSITIVE], by_name[INSENSITIVE]
    others = [unit.error["W4A16-g32"] for unit in units if unit not in (sensitive, insensitive)]
    assert sensitive.error["W4A16-g32"] > 3 * max(others)
    assert insensitive.error["W4A16-g32"] < 1e-6 * sensitive.error["W4A16-g32"]
    assert insensitive.cost["W4A16-g32"] < insensitive.cost["W8A16"] < insensitive.cost["keep"] == 64 * 64 * 4  # float32 checkpoint
    mixes = frontier(units, {"keep", "W8A16", "W4A16-g32"})
    # the first mix that does not leave the sensitive Linear at 4 bits keeps the insensitive one at 4 bits
    first = next(mix for mix in mixes if mix.choice[units.index(sensitive)] != "W4A16-g32")
    assert first.choice[units.index(sensitive)] == "W8A16" and first.choice[units.index(insensitive)] == "W4A16-g32"
    assert mixes.index(first) == 1  # the sensitive Linear is the first to leave 4 bits


@pytest.mark.slow
def test_tune_finds_publishes_and_resumes(tmp_path, constructed, calib_file, monkeypatch):
    import llmc.tune.search as search

    path = tune_file(tmp_path, constructed, calib_file, "match_cost_of: [W4A16-g32]\n")
    quantized = []
    real_quantize, real_evaluate = search.run_quantize, search.Evaluator.evaluate
    monkeypatch.setattr(search, "run_quantize",
                        lambda recipe, **options: quantized.append(recipe.output) or real_quantize(recipe, **options))

    def killed_after_one(self, name, artifact):
        if self.state.points:
            raise KeyboardInterrupt
        return real_evaluate(self, name, artifact)

    monkeypatch.setattr(search.Evaluator, "evaluate", killed_after_one)
    assert llmc_in_process("tune", str(path)).returncode == 130  # Ctrl-C in the second evaluation
    first = list(quantized)
    assert len(first) == 2 and not (tmp_path / "out").exists()
    monkeypatch.setattr(search.Evaluator, "evaluate", real_evaluate)
    again = llmc_in_process("tune", str(path))
    assert again.returncode == 2 and "holds a stopped tune: rerun with --resume" in again.stderr
    run = llmc_in_process("tune", str(path), "--resume", "--set", "eval.gate.max_kl=0.04")  # thresholds may change
    assert run.returncode == 0, run.stderr
    assert first[0] not in quantized[2:]  # the finished evaluation is not run again

    out = tmp_path / "out"
    summary = json.loads((out / "tune" / "tune.json").read_text())
    choice = summary["winner_choice"]
    assert choice["0:down_proj"] == "W8A16" and choice["1:o_proj"] == "W4A16-g32"
    points = {point["name"]: point for point in summary["points"]}
    winner = points[summary["winner"]]
    assert winner["passed"] and winner["cost"] < points["uniform W8A16"]["cost"]
    assert not points["uniform W4A16-g32"]["passed"]
    assert "at the cost of W4A16-g32" in points
    assert {"report.md", "pareto.png", "tune.json", "points"} <= {item.name for item in (out / "tune").iterdir()}
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = {group["weights"]["num_bits"]: group["targets"] for group in config["config_groups"].values()}
    assert SENSITIVE in groups[8] and INSENSITIVE in groups[4]
    assert not (tmp_path / "out.tune-work").exists()
    manifest = json.loads((out / "llmc.json").read_text())  # every file as published, hashed
    assert manifest["tune"]["winner"] == summary["winner"] and manifest["eval"]["gate"]["passed"]
    assert {"recipe.yaml", "tune/report.md", "report/report.md"} <= set(manifest["files"])
    assert manifest["files"]["recipe.yaml"] == hashlib.sha256((out / "recipe.yaml").read_bytes()).hexdigest()

    # the published recipe is a plain `llmc quantize` recipe that makes the same artifact
    rerun = llmc_in_process("quantize", str(out / "recipe.yaml"), "--output", str(tmp_path / "again"))
    assert rerun.returncode == 0, rerun.stderr
    made, published = artifact_tensors(tmp_path / "again"), artifact_tensors(out)
    assert made.keys() == published.keys() and all(torch.equal(made[name], published[name]) for name in made)
    taken = llmc_in_process("tune", str(path))
    assert taken.returncode == 2 and "already exists" in taken.stderr


@pytest.mark.parametrize("change, message", [
    ("candidates: [keep, W5A16]", r"line \d+: candidates.1.scheme: unknown scheme 'W5A16'"),
    ("candidates: [keep, {scheme: keep, name: plain}]", "tune file .*\n.*candidates: list at least one scheme besides keep"),
    ("candidates: [W8A16, {scheme: W8A16}]", "W8A16 listed twice; give one a name"),
    ("candidates: [keep, FP8]", "candidates.1 \\(FP8\\): its inputs take a calibrated"),
    ("candidates: [keep, FP8_BLOCK]\nalgorithm: {type: gptq}", "candidates.1 \\(FP8_BLOCK\\) with algorithm gptq: .*cannot fix 2-D block"),
    ("match_cost_of: [W4A16]", "match_cost_of: W4A16 not among the candidates"),
    ("objective: {gpu: X1}", "objective.gpu: 'X1' is not in the table"),
    ("max_evaluations: 0", r"line \d+: max_evaluations: Input should be greater than or equal to 1"),
])
def test_a_bad_tune_file_is_one_error_naming_the_field(tmp_path, tiny_llama, calib_file, change, message):
    path = tune_file(tmp_path, tiny_llama, calib_file)
    text = path.read_text()
    key = change.split(":")[0]
    lines = [line for line in text.splitlines() if not line.startswith(f"{key}:")]
    path.write_text("\n".join(lines) + "\n" + change + "\n")
    run = llmc_in_process("tune", str(path))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert __import__("re").search(message, run.stderr), run.stderr


def test_a_tune_needs_a_gate(tmp_path, tiny_llama, calib_file):
    path = tune_file(tmp_path, tiny_llama, calib_file, gate="null")
    run = llmc_in_process("tune", str(path))
    assert run.returncode == 2 and "eval.gate: a tune searches for the cheapest mix that passes a gate" in run.stderr


@pytest.mark.slow
def test_a_draft_is_trained_on_the_winner_and_gated(tmp_path, constructed, calib_file, monkeypatch):
    monkeypatch.setenv("LLMC_HOME", str(tmp_path / "home"))  # the distillation cache
    draft = (f"draft: {{method: medusa, prompts: [{calib_file}], num_prompts: 6, max_tokens: 24, num_heads: 2, steps: 30, "
             "batch_size: 32}\nmax_evaluations: 2\n")
    path = tune_file(tmp_path, constructed, calib_file, draft, gate="{max_kl: 0.05, min_accepted_length: 4.5}")
    run = llmc_in_process("tune", str(path))  # a chain of 3 accepts at most 4: the winner's draft cannot pass
    assert run.returncode == 3 and "the draft of the winner" in run.stderr and "min_accepted_length 4.5" in run.stderr
    assert not (tmp_path / "out").exists() and (tmp_path / "out.tune-work").is_dir()
    path.write_text(path.read_text().replace("min_accepted_length: 4.5", "min_accepted_length: 1.0"))
    run = llmc_in_process("tune", str(path), "--discard-partial")
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "out" / "draft" / "heads.safetensors").is_file()
    summary = json.loads((tmp_path / "out" / "tune" / "tune.json").read_text())
    winner = next(point for point in summary["points"] if point["name"] == summary["winner"])
    assert 1.0 <= winner["accepted_length"] <= 3.0
    assert "draft:" in (tmp_path / "out" / "recipe.yaml").read_text()


def test_the_default_candidates(tmp_path, tiny_llama, calib_file):
    path = tune_file(tmp_path, tiny_llama, calib_file)
    path.write_text("\n".join(line for line in path.read_text().splitlines() if not line.startswith("candidates:")) + "\n")
    assert [candidate.label for candidate in load_tune(path).candidates] == [
        "keep", "W8A16", "W8A8", "FP8_DYNAMIC", "W4A16-g128", "W4A16-g64", "NVFP4A16", "MXFP4A16"]
