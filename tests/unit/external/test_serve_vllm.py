"""`llmc serve --engine vllm`: the `vllm serve` command line it hands over to, checked with a stand-in `vllm` that
prints its arguments, and the errors when vLLM is missing or an option has no vLLM equivalent."""
import os
import subprocess
from pathlib import Path

import pytest
from helpers import llmc_in_process, llmc_process

from llmc.core.errors import LlmcError
from llmc.external import vllm_server


def serve_in_own_process(*args: str) -> subprocess.CompletedProcess:
    """`llmc serve ARGS` in its own process, which becomes vLLM's (exec)."""
    return llmc_process("serve", *args, timeout=120)


@pytest.fixture
def no_exec(monkeypatch):
    """In process, an exec would replace pytest with vLLM: reaching it fails the test instead."""
    def refuse(path, args):
        raise AssertionError(f"exec {args}")

    monkeypatch.setattr(os, "execv", refuse)


@pytest.fixture
def fake_vllm(tmp_path) -> Path:
    """A `vllm` that prints its arguments one a line, leaves a mark that it ran, and exits 7."""
    path = tmp_path / "vllm"
    path.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\"\ntouch {tmp_path / 'ran'}\nexit 7\n")
    path.chmod(0o755)
    return path


def test_missing_vllm_is_one_clear_error(no_exec):
    run = llmc_in_process("serve", "--engine", "vllm", "--vllm", "/nonexistent", "artifacts/x")
    assert run.returncode != 0
    assert run.stderr.startswith("error: vLLM not found: /nonexistent") and "Traceback" not in run.stderr
    assert "benchmarks/vllm_venv.sh" in run.stderr and "pip install vllm" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_the_command_line_vllm_gets(fake_vllm, tmp_path):
    run = serve_in_own_process("--engine", "vllm", "--vllm", str(fake_vllm), "artifacts/x", "--host", "0.0.0.0", "--port", "9001",
                     "--api-key", "secret", "--max-model-len", "1024", "--max-num-seqs", "8", "--dtype", "float32",
                     "--", "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2")
    assert run.returncode == 7, run.stderr  # vLLM's own exit code: llmc became it
    assert run.stdout.splitlines() == [
        "serve", "artifacts/x", "--host", "0.0.0.0", "--port", "9001", "--api-key", "secret", "--served-model-name", "artifacts/x",
        "--max-model-len", "1024", "--max-num-seqs", "8", "--dtype", "float32",
        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
    ]


def test_defaults_are_llmc_serves(fake_vllm):
    run = serve_in_own_process("--engine", "vllm", "--vllm", str(fake_vllm), "artifacts/x", "--served-model-name", "x")
    assert run.stdout.splitlines() == ["serve", "artifacts/x", "--host", "127.0.0.1", "--port", "8000", "--served-model-name", "x"]


def test_options_without_a_vllm_equivalent_are_refused(fake_vllm, tmp_path, no_exec):
    run = llmc_in_process("serve", "--engine", "vllm", "--vllm", str(fake_vllm), "artifacts/x",
                          "--max-waiting", "3", "--speculative", "off")
    assert run.returncode == 2 and not (tmp_path / "ran").exists()
    assert run.stderr.startswith("error: --speculative, --max-waiting: no vLLM equivalent for --engine vllm"), run.stderr


def test_vllm_arguments_need_the_vllm_engine(no_exec):
    run = llmc_in_process("serve", "artifacts/x", "--", "--tensor-parallel-size", "8")
    assert run.returncode == 2 and run.stderr == "error: --tensor-parallel-size 8: only with --engine vllm\n"


def test_llmc_options_map_onto_vllm_flags():
    options = {"kv_cache_gib": 0.5, "no_prefix_caching": True, "max_num_batched_tokens": 256}
    command = vllm_server.vllm_command("/bin/vllm", "art", "127.0.0.1", 8000, None, "art", options)
    assert command[command.index("--kv-cache-memory-bytes") + 1] == str(2**29)
    assert "--no-enable-prefix-caching" in command and command[-2:] == ["--max-num-batched-tokens", "256"]
    with pytest.raises(LlmcError, match="--num-speculative-tokens: no vLLM equivalent"):
        vllm_server.vllm_command("/bin/vllm", "art", "127.0.0.1", 8000, None, "art", {"num_speculative_tokens": 3})


def test_vllm_is_looked_up_on_path_then_in_the_repository(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(vllm_server, "REPO_VENV_VLLM", tmp_path / "venv" / "bin" / "vllm")
    with pytest.raises(LlmcError, match="vLLM not found: no `vllm` on PATH nor .*venv/bin/vllm; install it"):
        vllm_server.find_vllm(None)
    vllm_server.REPO_VENV_VLLM.parent.mkdir(parents=True)
    vllm_server.REPO_VENV_VLLM.write_text("#!/bin/sh\n")
    vllm_server.REPO_VENV_VLLM.chmod(0o755)
    assert vllm_server.find_vllm(None) == str(vllm_server.REPO_VENV_VLLM)
    on_path = tmp_path / "vllm"
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    assert vllm_server.find_vllm(None) == str(on_path)
    assert vllm_server.find_vllm("vllm") == str(on_path)


def test_the_repository_venv_is_looked_for_at_the_repository_root():
    import llmc
    from llmc.external import vllm_server

    assert vllm_server.REPO_VENV_VLLM == Path(llmc.__file__).resolve().parents[1] / ".vllm-venv" / "bin" / "vllm"
