"""A server run as a subprocess (vLLM beside llmc's speculative measurement, either engine in the benchmarks): its
output to a log, in use once a URL answers 200, stopped on the way out with every process it started."""
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from llmc.core.errors import LlmcError


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def served(name: str, command: list[str], env: dict[str, str], log: Path, ready_url: str, timeout_s: float) -> Iterator[subprocess.Popen]:
    """The process of `command`, once ready_url answers; an LlmcError naming the log's last error line if it exits
    first, or if it does not answer within timeout_s."""
    with open(log, "w") as output:  # the server writes through its own copy of the descriptor
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_ready(name, process, log, ready_url, timeout_s)
        yield process
    finally:
        stop(process)


def wait_until_ready(name: str, process: subprocess.Popen, log: Path, ready_url: str, timeout_s: float) -> None:
    started = time.monotonic()
    while True:
        if process.poll() is not None:
            errors = [line for line in log.read_text().splitlines() if "Error" in line] or ["(no error line)"]
            raise LlmcError(f"{name} exited with {process.returncode} before serving (log {log}): {errors[-1][-400:]}")
        if time.monotonic() - started > timeout_s:
            raise LlmcError(f"{name} did not answer within {timeout_s:.0f} s (log {log})")
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the process's session (vLLM's engine and workers too), SIGKILL after 30 s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
