import json

import pytest
from helpers import llmc_in_process, llmc_process, write_recipe

STAGE = "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n"


@pytest.mark.slow
def test_quantize_inspect_eval(tmp_path, tiny_llama, calib_file, eval_file):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "unused", STAGE, calib_file)
    output = tmp_path / "out"
    run = llmc_process("quantize", str(recipe), "--output", str(output), "--set", "calibration.num_samples=2",
               "--set", f"eval.perplexity.dataset={eval_file}", "--set", "eval.perplexity.seq_len=32",
               "--set", "eval.perplexity.max_windows=2")
    assert run.returncode == 0, run.stderr
    assert "quantizing layers" in run.stderr
    assert not (tmp_path / "unused").exists()
    info = json.loads(llmc_process("inspect", str(output), "--json").stdout)
    manifest = info["manifest"]
    assert manifest["calibration"]["num_samples"] == 2
    assert set(manifest["eval"]["targets"]) == {"artifact", "baseline"} and manifest["eval"]["baseline"] == "baseline"
    assert (output / "report" / "perplexity.png").is_file()
    assert info["config_groups"]["group_0"]["group_size"] == 32
    assert "int4" not in llmc_process("inspect", str(output)).stderr
    assert "group_0" in llmc_process("inspect", str(output)).stdout

    single = llmc_process("eval", str(output), "--perplexity", str(eval_file), "--seq-len", "32", "--max-windows", "2", "--json")
    assert single.returncode == 0, single.stderr
    result = json.loads(single.stdout)["targets"][str(output)]["perplexity"]
    assert result["tokens"] == 62 and result["perplexity"] == manifest["eval"]["targets"]["artifact"]["perplexity"]["perplexity"]
    table = llmc_process("eval", str(tiny_llama), str(tiny_llama), "--perplexity", str(eval_file), "--seq-len", "32", "--max-windows", "2")
    assert table.returncode == 0 and "+0.00%" in table.stdout and "100.0%" not in table.stdout


def test_bad_recipe_exits_nonzero_without_traceback_or_output(tmp_path, tiny_llama):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", STAGE.replace("group_size", "gruop_size"))
    run = llmc_in_process("quantize", str(recipe))
    assert run.returncode == 2
    assert "stages.0.weights.gruop_size: unknown key" in run.stderr and "line 6" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_user_mistakes_are_one_line_errors(tmp_path):
    missing = llmc_in_process("eval", "no-such-model-xyz", "--perplexity", "wikitext2")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    nothing = llmc_in_process("eval", "smollm2-135m")
    assert nothing.returncode == 2 and "nothing to evaluate" in nothing.stderr
    bad_set = tmp_path / "set.jsonl"
    bad_set.write_text('{"prompt": "hi", "reference": "x", "metric": "exact"}\n{"prompt": "hi"}\n')
    malformed = llmc_in_process("eval", "smollm2-135m", "--business", str(bad_set))
    assert malformed.returncode == 2 and "set.jsonl line 2: metric" in malformed.stderr and "Traceback" not in malformed.stderr
    not_artifact = llmc_in_process("inspect", str(tmp_path))
    assert not_artifact.returncode == 2 and "not an llmc artifact" in not_artifact.stderr
