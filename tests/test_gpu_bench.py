"""benchmarks/gpu_bench.py's code path on CPU (--smoke: SmolLM2 shapes, 2 layers, a few tokens): every format builds
its random weights, decodes at batch 1 and at concurrency, and lands in the table without an error."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FORMATS = ["fp16", "W4A16", "W8A8", "FP8", "FP8 per-tensor", "W4A16 + FP8 KV"]


@pytest.mark.slow
def test_gpu_bench_smoke_runs_every_format_on_cpu():
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
