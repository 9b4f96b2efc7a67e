import json
import subprocess
import sys

import pytest
from helpers import CORPUS, llmc_in_process, write_recipe

from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe


@pytest.mark.slow
def test_bench_in_process_with_cancellations_and_hf_baseline(tmp_path, tiny_llama):
    stage = "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n"
    artifact = run_quantize(load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "artifact", stage)))
    dataset = tmp_path / "prompts.jsonl"
    sentences = CORPUS.split(". ")[:4]
    dataset.write_text("".join(json.dumps({"turns": [s, "second turn"]}) + "\n" for s in sentences[:2])
                       + "".join(json.dumps({"prompt": s}) + "\n" for s in sentences[2:]))
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "llmc", "bench", str(artifact), "--dataset", str(dataset), "--num-prompts", "10",
         "--max-tokens", "12", "--concurrency", "3", "--cancel-fraction", "0.5", "--shared-prefix-tokens", "40",
         "--baseline", "hf", "--baseline-num-prompts", "2", "--dtype", "float32", "--kv-cache-gib", "0.01", "--json", str(out)],
        capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stderr
    results = json.loads(out.read_text())
    llmc, hf = results["llmc"], results["hf"]
    assert llmc["completed"] + llmc["cancelled"] == 10 and llmc["cancelled"] > 0
    assert llmc["leaked_blocks"] == 0 and 0 < llmc["kv_token_occupancy_at_peak"] <= 1
    assert hf["completed"] == 2 and hf["total_output_tokens"] == 24
    assert llmc["total_output_tokens"] >= 12 * llmc["completed"]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert set(llmc[metric]) == {"mean_ms", "p50_ms", "p90_ms", "p99_ms"}
    assert results["speedup"]["output_throughput"] > 0 and "TPOT p99" in run.stdout


def test_bench_reports_a_missing_dataset_cleanly(tmp_path):
    run = llmc_in_process("bench", str(tmp_path), "--dataset", str(tmp_path / "none.jsonl"))
    assert run.returncode == 2 and "error:" in run.stderr and "Traceback" not in run.stderr
