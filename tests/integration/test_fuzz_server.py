"""schemathesis (a property-based fuzzer driven by the server's own OpenAPI schema) against `llmc serve`'s generation
endpoints on the tiny model, valid and invalid bodies alike: no 5xx, no response that breaks the schema, and a
server still healthy and idle at the end. Bounded for CI; benchmarks/fuzz_server.py runs the long version."""
import sys
from pathlib import Path

import httpx
import pytest
import torch
from helpers import build_tiny_model, in_process_server

from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.serving.engine_process import EngineProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from fuzz_server import API_KEY, fuzz  # noqa: E402

EXAMPLES_PER_OPERATION = 60


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("fuzzed"))
    engine = EngineProcess(model, EngineConfig(dtype=torch.float32, max_num_seqs=4, num_kv_blocks=128), threads=1, max_waiting=4)
    with in_process_server(engine, API_KEY) as running:
        yield running


@pytest.mark.slow
def test_no_generated_request_gets_a_5xx_or_breaks_the_schema(fuzzed):
    report = fuzz(fuzzed.base, EXAMPLES_PER_OPERATION)
    assert report.failures == [] and report.server_errors == 0
    assert report.sent >= 2 * 2 * EXAMPLES_PER_OPERATION


def test_the_server_is_healthy_and_idle_after_the_fuzzing(fuzzed):
    assert httpx.get(f"{fuzzed.base}/health").status_code == 200
    assert fuzzed.engine.num_requests == 0
    body = {"prompt": "The quick brown fox", "max_tokens": 4}
    response = httpx.post(f"{fuzzed.base}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert response.status_code == 200
