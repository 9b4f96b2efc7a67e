"""The quality gate end to end: `llmc quantize` writes the artifact only when every threshold holds."""
import json

import pytest
from helpers import llmc_in_process, llmc_process, write_recipe

STAGE = "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n"


def business_set(path):
    items = [{"id": f"q{n}", "prompt": f"Say {word}", "reference": word, "metric": "contains", "max_tokens": 4, "tags": ["t"]}
             for n, word in enumerate(["fox", "dog", "time", "memory"])]
    items.append({"id": "pick", "prompt": "Which animal?", "choices": ["fox", "lazy dog"], "reference": "A", "metric": "choice"})
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def gate_recipe(tmp_path, tiny_llama, eval_file, gate: str):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", STAGE)
    recipe.write_text(recipe.read_text() + f"""eval:
  perplexity: {{dataset: {eval_file}, seq_len: 32, max_windows: 2}}
  business: {{dataset: {business_set(tmp_path / "set.jsonl")}}}
  gate: {gate}
""")
    return recipe


@pytest.mark.slow
def test_gate_passes_and_the_manifest_records_it(tmp_path, tiny_llama, eval_file):
    recipe = gate_recipe(tmp_path, tiny_llama, eval_file, "{max_perplexity_increase: 10.0, max_kl: 100.0}")
    run = llmc_process("quantize", str(recipe))
    assert run.returncode == 0, run.stderr
    manifest = json.loads((tmp_path / "out" / "llmc.json").read_text())
    assert manifest["eval"]["gate"] == {"thresholds": {"max_perplexity_increase": 10.0, "max_kl": 100.0}, "passed": True, "failures": []}
    assert "items" not in manifest["eval"]["targets"]["artifact"]["business"]
    assert manifest["eval"]["targets"]["artifact"]["target"] == str(tmp_path / "out")
    report = tmp_path / "out" / "report"
    assert {"report.json", "report.md", "kl.png", "perplexity.png"} <= {path.name for path in report.iterdir()}
    assert "report/report.md" in manifest["files"]
    assert "Gate: PASSED" in (report / "report.md").read_text()
    assert "mean KL" in llmc_process("inspect", str(tmp_path / "out")).stdout


@pytest.mark.slow
def test_gate_failure_writes_no_artifact_and_keeps_the_report_beside(tmp_path, tiny_llama, eval_file):
    recipe = gate_recipe(tmp_path, tiny_llama, eval_file, "{max_perplexity_increase: 0.0001, max_kl: 100.0}")
    run = llmc_in_process("quantize", str(recipe))
    assert run.returncode == 3, run.stderr
    assert "gate failed" in run.stderr and "perplexity increase" in run.stderr and "> max_perplexity_increase 0.0001 (over by" in run.stderr
    assert "mean KL" not in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial*"))
    beside = tmp_path / "out.gate-report"
    report = json.loads((beside / "report.json").read_text())
    assert report["gate"]["passed"] is False and "Gate: FAILED" in (beside / "report.md").read_text()


@pytest.mark.slow
def test_eval_gate_option_and_its_mistakes(tmp_path, tiny_llama, tiny_qwen2):
    common = ["eval", str(tiny_llama), str(tiny_llama), "--business", str(business_set(tmp_path / "set.jsonl"))]
    held = llmc_in_process(*common, "--gate", "min_agreement=1", "--gate", "max_kl=0", "--out", str(tmp_path / "report"))
    assert held.returncode == 0, held.stderr
    assert "100.0%" in held.stdout and (tmp_path / "report" / "business_by_tag.png").is_file()
    failed = llmc_in_process("eval", str(tiny_llama), str(tiny_qwen2), "--business", str(tmp_path / "set.jsonl"), "--gate", "max_kl=0.001")
    assert failed.returncode == 3 and f"{tiny_qwen2}: mean KL" in failed.stderr and "> max_kl 0.001" in failed.stderr
    alone = llmc_in_process("eval", str(tiny_llama), "--business", str(tmp_path / "set.jsonl"), "--gate", "max_kl=0.1")
    assert alone.returncode == 2 and "at least two targets" in alone.stderr
    unmeasured = llmc_in_process(*common, "--gate", "max_perplexity_increase=0.1")
    assert unmeasured.returncode == 2 and "needs eval.perplexity" in unmeasured.stderr
    typo = llmc_in_process(*common, "--gate", "min_recovry=0.9")
    assert typo.returncode == 2 and "gate.min_recovry" in typo.stderr and "Traceback" not in typo.stderr
