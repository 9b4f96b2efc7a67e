"""schemathesis (a property-based fuzzer driven by the server's own OpenAPI schema) against `llmc serve`'s generation
endpoints on the tiny model, valid and invalid bodies alike: no 5xx, no response that breaks the schema, and a
server still healthy and idle at the end. Bounded for CI; benchmarks/fuzz_server.py runs the long version."""
import httpx
import pytest
import schemathesis
import torch
from conftest import build_tiny_model, in_process_server
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.serving.engine_process import EngineProcess

API_KEY = "fuzz-key"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
EXAMPLES_PER_OPERATION = 60


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("fuzzed"))
    engine = EngineProcess(model, EngineConfig(dtype=torch.float32, max_num_seqs=4, num_kv_blocks=128), threads=1, max_waiting=4)
    with in_process_server(engine, API_KEY) as running:
        yield running


def fuzz(base: str, examples_per_operation: int) -> int:
    """Every generation operation of the server's schema, fed valid and invalid bodies; each response checked.
    Returns the number of requests sent (a failed check raises)."""
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json").include(path_regex=r"^/v1/(chat/)?completions$")
    sent = 0
    for operation in (result.ok() for result in schema.get_all_operations()):
        for mode in GenerationMode:
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples_per_operation, deadline=None, phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck), database=None)
            def call(case):
                nonlocal sent
                sent += 1
                case.call_and_validate(base_url=base, headers={"Authorization": f"Bearer {API_KEY}"}, checks=CHECKS, timeout=120)

            call()
    return sent


def test_no_generated_request_gets_a_5xx_or_breaks_the_schema(fuzzed):
    assert fuzz(fuzzed.base, EXAMPLES_PER_OPERATION) >= 2 * 2 * EXAMPLES_PER_OPERATION


def test_the_server_is_healthy_and_idle_after_the_fuzzing(fuzzed):
    assert httpx.get(f"{fuzzed.base}/health").status_code == 200
    assert fuzzed.engine.num_requests == 0
    body = {"prompt": "The quick brown fox", "max_tokens": 4}
    response = httpx.post(f"{fuzzed.base}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert response.status_code == 200
