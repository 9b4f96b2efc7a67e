"""schemathesis (a property-based fuzzer driven by the server's own OpenAPI schema) against a real `llmc serve`
subprocess, both generation endpoints, valid (positive) and invalid (negative) bodies: requests sent, responses by
status, 5xx and every failed check (collected, not stopped at), the server's RSS (HTTP process and the engine) at
start and end, and /health at the end. tests/integration/test_fuzz_server.py runs `fuzz` bounded for CI.

    python benchmarks/fuzz_server.py /tmp/soak-artifact --examples 500 --threads 1 --max-model-len 512 \
        --served-model-in-valid-bodies --minutes 7 --json fuzz.json
"""
import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import Failure, FailureGroup

REPO = Path(__file__).resolve().parents[1]
API_KEY = "fuzz-key"
MODEL_NAME = "fuzz"  # the server's --served-model-name
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
GENERATION_PATHS = r"^/v1/(chat/)?completions$"
MAX_REPRODUCERS_KEPT = 20


def count(counts: dict, key) -> None:
    counts[key] = counts.get(key, 0) + 1


@dataclass
class FuzzFailure:
    kind: str  # the check's title, or the transport error's class
    operation: str
    curl: str  # the exact request, to reproduce it


@dataclass
class FuzzReport:
    sent: int = 0
    sent_by_operation_and_mode: dict[str, int] = field(default_factory=dict)
    statuses: dict[int, int] = field(default_factory=dict)
    failures_by_kind: dict[str, int] = field(default_factory=dict)
    failures: list[FuzzFailure] = field(default_factory=list)  # the first MAX_REPRODUCERS_KEPT of each kind

    @property
    def server_errors(self) -> int:
        return sum(count for status, count in self.statuses.items() if status >= 500)

    def record_failure(self, kind: str, operation: str, curl: str) -> None:
        count(self.failures_by_kind, kind)
        if self.failures_by_kind[kind] <= MAX_REPRODUCERS_KEPT:
            self.failures.append(FuzzFailure(kind, operation, curl))


def failure_kinds(error: AssertionError) -> list[str]:
    if isinstance(error, FailureGroup):
        return [failure.title for failure in error.exceptions]
    return [error.title if isinstance(error, Failure) else type(error).__name__]


def fuzz(base: str, examples_per_operation: int, api_key: str = API_KEY, timeout_s: float = 120,
         progress_every: int = 0, served_model: str | None = None, budget_s: float | None = None) -> FuzzReport:
    """Every generation operation of the server's schema, fed valid and invalid bodies; each response checked, and a
    failed check or a transport error recorded with its request rather than raised. served_model: put in every valid
    body's `model`, so that the generated requests reach the engine instead of a 404 for a made-up model name.
    budget_s: each operation and mode gets an equal share of what is left of it when it starts (a run that ends
    early leaves its time to the later ones), then skips the examples left."""
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json").include(path_regex=GENERATION_PATHS)
    # invalid bodies first: they are answered at once, and what they leave of the budget goes to the valid ones
    modes = (GenerationMode.NEGATIVE, GenerationMode.POSITIVE)
    runs = [(result.ok(), mode) for result in schema.get_all_operations() for mode in modes]
    end = time.monotonic() + (budget_s or float("inf"))
    report = FuzzReport()
    for index, (operation, mode) in enumerate(runs):
        deadline = time.monotonic() + (end - time.monotonic()) / (len(runs) - index)
        fuzz_operation(operation, mode, base, {"Authorization": f"Bearer {api_key}"}, examples_per_operation, timeout_s,
                       progress_every, served_model if mode == GenerationMode.POSITIVE else None, report, deadline)
    return report


def fuzz_operation(operation, mode: GenerationMode, base: str, headers: dict[str, str], examples: int, timeout_s: float,
                   progress_every: int, served_model: str | None, report: FuzzReport, deadline: float) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck), database=None)
    def call(case):
        if time.monotonic() > deadline:
            return
        report.sent += 1
        if progress_every and report.sent % progress_every == 0:
            print(f"sent {report.sent}, statuses {report.statuses}, failed checks {report.failures_by_kind}", flush=True)
        if served_model is not None and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = served_model
        count(report.sent_by_operation_and_mode, f"{operation.label} {mode.value}")
        try:
            response = case.call(base_url=base, headers=headers, timeout=timeout_s)
        except requests.RequestException as error:  # no answer at all: the server hung or went away
            report.record_failure(type(error).__name__, operation.label, case.as_curl_command(headers=headers))
            return
        count(report.statuses, response.status_code)
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except AssertionError as error:
            for kind in failure_kinds(error):
                report.record_failure(kind, operation.label, case.as_curl_command(headers=headers))

    call()


def server_rss_mib(pid: int) -> float:
    """The server's resident memory: its HTTP process and every process below it (the engine)."""
    server = psutil.Process(pid)
    processes = [server, *server.children(recursive=True)]
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def health(base: str) -> int | str:
    try:
        return httpx.get(f"{base}/health", timeout=10).status_code
    except httpx.HTTPError as error:
        return type(error).__name__


@contextmanager
def llmc_serve(model: str, threads: int, api_key: str, log: Path, *options: str) -> Iterator[tuple[int, str]]:
    """`llmc serve MODEL` as a subprocess on a free port, once /health answers: (its pid, base url)."""
    from llmc.external.server_process import free_port, served

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "llmc", "serve", model, "--port", str(port), "--threads", str(threads),
               "--api-key", api_key, *options]
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    with served("llmc serve", command, env, log, f"{base}/health", timeout_s=300) as process:
        yield process.pid, base


@dataclass
class FuzzRun:
    model: str
    examples_per_operation: int
    minutes_budget: float | None
    seconds: float
    rss_start_mib: float
    rss_end_mib: float
    health_end: int | str
    report: FuzzReport


def print_run(run: FuzzRun) -> None:
    report = run.report
    rows = [("examples per operation and mode", run.examples_per_operation), ("time budget (min)", run.minutes_budget),
            ("requests sent", report.sent), ("sent by operation and mode", report.sent_by_operation_and_mode),
            ("responses by status", dict(sorted(report.statuses.items()))), ("5xx", report.server_errors),
            ("failed checks by kind", dict(report.failures_by_kind) or "none"),
            ("RSS start / end (MiB)", f"{run.rss_start_mib:.0f} / {run.rss_end_mib:.0f}"),
            ("/health at the end", run.health_end), ("wall time (s)", f"{run.seconds:.0f}")]
    for name, value in rows:
        print(f"{name:34} {value}")
    for failure in report.failures:
        print(f"\n{failure.kind} ({failure.operation}):\n{failure.curl}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="artifact folder or model spec for `llmc serve`")
    parser.add_argument("--examples", type=int, default=500, help="examples per operation and generation mode")
    parser.add_argument("--minutes", type=float, help="time budget, shared by each operation and mode")
    parser.add_argument("--threads", type=int, default=1, help="the engine's CPU threads")
    parser.add_argument("--max-model-len", type=int,
                        help="the server's context: bounds how long a generated request without max_tokens decodes "
                             "(the model's 8192 tokens take minutes on a CPU)")
    parser.add_argument("--served-model-in-valid-bodies", action="store_true",
                        help="valid bodies name the served model (else most get 404 for a made-up name)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    log = Path(tempfile.mkdtemp(prefix="fuzz-server-")) / "server.log"
    print(f"server log: {log}", flush=True)
    options = ["--served-model-name", MODEL_NAME] if args.served_model_in_valid_bodies else []
    if args.max_model_len:
        options += ["--max-model-len", str(args.max_model_len)]
    with llmc_serve(args.model, args.threads, API_KEY, log, *options) as (pid, base):
        rss_start, started = server_rss_mib(pid), time.monotonic()
        served_model = MODEL_NAME if args.served_model_in_valid_bodies else None
        budget_s = args.minutes * 60 if args.minutes else None
        report = fuzz(base, args.examples, progress_every=200, served_model=served_model, budget_s=budget_s)
        seconds = time.monotonic() - started
        run = FuzzRun(args.model, args.examples, args.minutes, seconds, rss_start, server_rss_mib(pid), health(base), report)
    print_run(run)
    if args.json:
        args.json.write_text(json.dumps(asdict(run), indent=2, default=str))


if __name__ == "__main__":
    main()
