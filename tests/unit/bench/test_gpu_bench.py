"""benchmarks/gpu_bench.py's and speculative_gpu.py's code paths on CPU (--smoke: SmolLM2 shapes, 2 layers, a few
tokens), as benchmarks/gpu_check.sh runs them on a GPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
FORMATS = ["fp16", "W4A16", "W8A8", "FP8", "FP8 per-tensor", "W4A16 + FP8 KV"]


@pytest.mark.slow
def test_gpu_bench_smoke_runs_every_format_on_cpu():
    """Every format builds its random weights, decodes at batch 1 and at concurrency, and lands in the table."""
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_bench.py", "--device", "cpu", "--smoke"], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    header, *rows = result.stdout.strip().split("\n\n")[-1].splitlines()
    expected_header = ["model", "format", "kernel", "weights", "GB", "batch-1", "tok/s", "MBU", "tok/s", "@", "3"]
    assert header.split() == expected_header, result.stderr[-3000:]
    assert [row[len("SmolLM2-135M  "):].split("  ")[0].strip() for row in rows] == FORMATS
    kernels = [row.split()[-5] for row in rows]  # on CPU in float16, int4 runs dequantized
    assert kernels == ["DenseLinear", "DenseLinear", *["QuantizedInputLinear"] * 3, "DenseLinear"]
    for row in rows:
        weights_gb, batch1, mbu, throughput = row.split()[-4:]
        assert float(weights_gb) > 0 and float(batch1) > 0 and float(throughput) > 0 and mbu == "n/a"


@pytest.mark.slow
def test_speculative_gpu_smoke_measures_plain_and_eagle3_steps_on_cpu():
    """benchmarks/speculative_gpu.py's code path: a random EAGLE-3 draft in the model's shape decodes in each shape, and
    the table combines the step costs with the given acceptances (speed-up = L / cost ratio)."""
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "benchmarks/speculative_gpu.py", "--device", "cpu", "--smoke", "--accepted", "2", "3"], cwd=REPO,
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    header, *rows = result.stdout.strip().split("\n\n")[-1].splitlines()
    assert header.split()[-3:] == ["2.00", "/", "3.00"]
    names = [row[:18].strip() for row in rows]
    assert names == ["plain", "plain, eager", "draft 3:0:0", "draft 4:7:0"], result.stdout
    plain_ms = float(rows[0].split()[1])
    for row in rows[2:]:
        ms, tokens, ratio, break_even, double, two, three = [cell for cell in row[18:].split() if cell != "/"]
        ratio = float(ratio)  # printed to 2 decimals: compared within 1% or the last digit
        assert float(tokens) >= 1 and ratio == pytest.approx(float(ms) / plain_ms, rel=0.01), result.stdout
        assert float(break_even) == ratio and float(double) == pytest.approx(2 * ratio, rel=0.01), result.stdout
        assert float(two.removeprefix("x")) == pytest.approx(2 / ratio, rel=0.01, abs=0.006), result.stdout
        assert float(three.removeprefix("x")) == pytest.approx(3 / ratio, rel=0.01, abs=0.006), result.stdout
