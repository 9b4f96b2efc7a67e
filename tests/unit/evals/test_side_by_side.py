"""Recovery, agreement and KL on a tiny model quantized two ways, and the report written from them."""
import json
from pathlib import Path

import pytest
from helpers import write_recipe

from llmc.evals.business import compare_business
from llmc.evals.business_set import load_business_set
from llmc.evals.config import eval_config
from llmc.evals.generation import GenerationRequest, make_generator
from llmc.evals.loading import load_model
from llmc.evals.report import write_report
from llmc.evals.suite import EvalTarget, evaluate_side_by_side
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe

PROMPTS = ["The quick brown fox", "A stitch in time", "Quantization maps real numbers", "Every generated token",
           "memory bandwidth", "the lazy dog", "trading accuracy for", "integers"]


@pytest.fixture(scope="module")
def quantized_two_ways(tmp_path_factory, tiny_llama) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("two-ways")
    artifacts = {}
    stages = {"w8": "  - type: rtn\n    scheme: W8A16\n", "w4": "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n"}
    for name, stage in stages.items():
        recipe = write_recipe(folder / f"{name}.yaml", tiny_llama, folder / name, stage)
        artifacts[name] = run_quantize(load_recipe(recipe))
    return artifacts


@pytest.fixture(scope="module")
def base_answer_set(tmp_path_factory, tiny_llama) -> Path:
    """Items whose references are the base model's own answers, so the base scores 1 on every item."""
    draft = tmp_path_factory.mktemp("set") / "draft.jsonl"
    draft.write_text("".join(json.dumps({"prompt": p, "reference": "x", "metric": "exact", "max_tokens": 6}) + "\n" for p in PROMPTS))
    requests = [GenerationRequest(item.prompt_messages, 6) for item in load_business_set(draft)]
    outputs = make_generator(load_model(str(tiny_llama))).generate(requests)
    path = draft.with_name("base_answers.jsonl")
    items = [
        {"id": f"i{n}", "prompt": p, "reference": o or "-", "metric": "exact", "max_tokens": 6, "tags": ["even" if n % 2 == 0 else "odd"]}
        for n, (p, o) in enumerate(zip(PROMPTS, outputs))
    ]
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def test_recovery_agreement_and_kl_order_the_two_quantizations(tmp_path, tiny_llama, quantized_two_ways, base_answer_set, eval_file):
    config = eval_config({"business": {"dataset": str(base_answer_set)},
                          "perplexity": {"dataset": str(eval_file), "seq_len": 32, "max_windows": 2}}, "test")
    targets = [EvalTarget("base", str(tiny_llama)), EvalTarget("same", str(tiny_llama)),
               EvalTarget("w8", str(quantized_two_ways["w8"])), EvalTarget("w4", str(quantized_two_ways["w4"]))]
    report = evaluate_side_by_side(targets, config)
    results = report["targets"]
    assert results["base"]["business"]["score"] == 1.0 and "vs_baseline" not in results["base"]
    same = results["same"]["vs_baseline"]
    assert same["recovery"] == 1.0 and same["agreement"] == 1.0 and same["perplexity_increase"] == 0.0
    assert same["kl"] == pytest.approx(0.0, abs=1e-9)
    w8, w4 = results["w8"]["vs_baseline"], results["w4"]["vs_baseline"]
    assert 0 < w8["kl"] < w4["kl"]
    assert w8["perplexity_increase"] < w4["perplexity_increase"]
    for label in ("w8", "w4"):
        comparison = results[label]["vs_baseline"]
        assert comparison["recovery"] == results[label]["business"]["score"]  # the base scores 1
        assert comparison["agreement"] <= comparison["recovery"] + 1e-9
        assert set(comparison["tag_recovery"]) == {"even", "odd"}

    write_report(report, tmp_path / "report")
    files = {path.name for path in (tmp_path / "report").iterdir()}
    assert {"report.json", "report.md", "perplexity.png", "business_by_tag.png", "recovery.png", "kl.png"} <= files
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "| w4 |" in markdown and "![kl.png](kl.png)" in markdown
    assert json.loads((tmp_path / "report" / "report.json").read_text())["targets"]["w4"]["business"]["items"]


def test_compare_business_counts_identical_answers():
    from llmc.evals.business import BusinessResult, ItemResult

    base = BusinessResult([ItemResult("a", ["t"], "exact", "yes", 1.0), ItemResult("b", ["t", "u"], "exact", "no", 1.0)])
    other = BusinessResult([ItemResult("a", ["t"], "exact", "yes", 1.0), ItemResult("b", ["t", "u"], "exact", "maybe", 0.0)])
    assert compare_business(base, other) == {"recovery": 0.5, "tag_recovery": {"t": 0.5, "u": 0.0}, "agreement": 0.5}
    assert compare_business(other, base)["tag_recovery"]["u"] is None  # a zero base score has no recovery
