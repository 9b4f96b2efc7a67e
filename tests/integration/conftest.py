"""Fixtures of the tests that run vLLM: its venv, built or reused by benchmarks/vllm_venv.sh."""
import re
import subprocess
import time
from pathlib import Path

import pytest
from vllm_comparison import VLLM_VENV

ROOT = Path(__file__).resolve().parents[2]
NETWORK_FAILURE = re.compile(r"No matching distribution|Could not find a version|NewConnectionError|Network is unreachable|"
                             r"Temporary failure in name resolution|Name or service not known|ConnectTimeout|ReadTimeout")


@pytest.fixture(scope="module")
def venv_build(tmp_path_factory):
    """The venv script, started first so that its download overlaps the quantization."""
    log = tmp_path_factory.mktemp("vllm-venv") / "build.log"
    with open(log, "w") as file:
        process = subprocess.Popen(["bash", str(ROOT / "benchmarks" / "vllm_venv.sh"), str(VLLM_VENV)], stdout=file,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    yield process, log
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def vllm_python(venv_build) -> Path:
    process, log = venv_build
    started = time.monotonic()
    returncode = process.wait(timeout=1800)
    output = log.read_text()
    print(f"\nvLLM venv {VLLM_VENV}: ready after {time.monotonic() - started:.0f} s more", flush=True)
    if returncode != 0:
        tail = "\n".join(line for line in output.splitlines() if not line.startswith("WARNING: Location"))[-1500:]
        if NETWORK_FAILURE.search(output):
            pytest.skip(f"vLLM's venv cannot be built here (no package index?): {tail.splitlines()[-1]}")
        pytest.fail(f"benchmarks/vllm_venv.sh failed ({returncode}):\n{tail}")
    return VLLM_VENV / "bin" / "python"
