"""`llmc serve --engine vllm`: the artifact served by vLLM's own server, `vllm serve`, which the llmc process becomes
(exec), so vLLM receives the signals and its exit code is the command's. llmc's options map onto vLLM's; an option
set explicitly that vLLM has no equivalent for is refused rather than dropped."""
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from llmc.core.errors import LlmcError
from llmc.external.server_process import free_port, served

REPO_VENV_VLLM = Path(__file__).resolve().parents[2] / ".vllm-venv" / "bin" / "vllm"
LOCAL_SERVED_NAME = "llmc-local"
STARTUP_TIMEOUT_S = 900
INSTALL_HINT = "pip install vllm, or benchmarks/vllm_venv.sh for vLLM's CPU build in .vllm-venv"

# llmc's engine options (cli.ENGINE_OPTIONS) as vLLM flags; each takes the option's value but the flags without one
VLLM_FLAGS = {
    "dtype": "--dtype",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "kv_cache_gib": "--kv-cache-memory-bytes",
    "no_prefix_caching": "--no-enable-prefix-caching",
}
VALUELESS_FLAGS = {"no_prefix_caching"}


def find_vllm(explicit: str | None) -> str:
    """The `vllm` executable: `explicit` (--vllm), else `vllm` on PATH, else the repository's .vllm-venv."""
    if explicit is not None:
        path = explicit if os.sep in explicit else shutil.which(explicit)
        if path is None or not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise LlmcError(f"vLLM not found: {explicit} is not an executable file ({INSTALL_HINT}, then --vllm VENV/bin/vllm)")
        return path
    found = shutil.which("vllm")
    if found is not None:
        return found
    if os.access(REPO_VENV_VLLM, os.X_OK):
        return str(REPO_VENV_VLLM)
    raise LlmcError(f"vLLM not found: no `vllm` on PATH nor {REPO_VENV_VLLM}; install it ({INSTALL_HINT}) or pass --vllm PATH")


def vllm_model(artifact: str) -> str:
    """What vLLM loads for llmc's model spec: folders and hub ids as given; an alias or .gguf as llmc's converted folder."""
    from llmc.checkpoints.spec import EMBEDDED_MODELS

    if artifact in EMBEDDED_MODELS or artifact.endswith(".gguf"):
        from llmc.checkpoints.spec import resolve_model

        return str(resolve_model(artifact))
    return artifact


def vllm_flag_value(name: str, value: object) -> str:
    if name == "kv_cache_gib":
        return str(int(float(value) * 2**30))
    return str(value)


def vllm_command(executable: str, artifact: str, host: str, port: int, api_key: str | None, served_model_name: str,
                 explicit_options: Mapping[str, object], passthrough: Sequence[str] = ()) -> list[str]:
    """argv of `vllm serve`; `explicit_options` holds only the llmc options the user set, by parameter name."""
    unmapped = [name for name in explicit_options if name not in VLLM_FLAGS]
    if unmapped:
        flags = ", ".join("--" + name.replace("_", "-") for name in unmapped)
        raise LlmcError(f"{flags}: no vLLM equivalent for --engine vllm; drop it, or pass vLLM's own options after `--`")
    command = [executable, "serve", vllm_model(artifact), "--host", host, "--port", str(port)]
    if api_key is not None:
        command += ["--api-key", api_key]
    command += ["--served-model-name", served_model_name]
    for name, value in explicit_options.items():
        if name in VALUELESS_FLAGS:
            if value:
                command.append(VLLM_FLAGS[name])
        else:
            command += [VLLM_FLAGS[name], vllm_flag_value(name, value)]
    return command + list(passthrough)


def exec_vllm(command: list[str]) -> NoReturn:
    try:
        os.execv(command[0], command)
    except OSError as error:
        raise LlmcError(f"cannot run {command[0]}: {error.strerror}") from None


@contextmanager
def local_vllm(executable: str, folder: str, flags: Sequence[str], log: Path, env: Mapping[str, str] = {}) -> Iterator[str]:
    """`vllm serve FOLDER --served-model-name llmc-local FLAGS` on a free local port with every core (unless the
    environment's own VLLM_CPU_* settings, or `env`, say otherwise), once it answers; its base URL. Stopped on the way
    out."""
    port = free_port()
    command = [executable, "serve", folder, "--host", "127.0.0.1", "--port", str(port), "--served-model-name",
               LOCAL_SERVED_NAME, *flags]
    cores = os.cpu_count() or 1
    defaults = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}
    url = f"http://127.0.0.1:{port}"
    with served("vllm serve", command, defaults | os.environ | dict(env), log, f"{url}/health", STARTUP_TIMEOUT_S):
        yield url
