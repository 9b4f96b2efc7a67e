"""Plain code the tests that run vLLM share: where its venv is, how it is run, and how llmc's greedy tokens are held
against vLLM's (the fixtures that build the venv are in tests/integration/conftest.py)."""
import functools
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

VLLM_VENV = Path(os.environ.get("LLMC_VLLM_VENV", Path(__file__).resolve().parents[1] / ".vllm-venv"))
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
NEAR_TIE = 1.0  # nats: a misread artifact's tokens are far less likely than this under the artifact as llmc reads it
MAX_MODEL_LEN = 256
# vLLM picks the AVX-512 build of its C++ ops (vllm/_C or _C_AVX512) by this same torch check, else _C_AVX2
AVX512 = torch.cpu._is_avx512_supported()
AMX = torch.cpu._is_amx_tile_supported()
MISSING_KERNEL = re.compile(r"has no attribute 'cpu_gemm_wna16'|Failed to find a kernel that can implement the WNA16 linear layer")


class VllmKernelMissing(Exception):
    """vLLM's CPU build has no kernel for the artifact's format (a limit of vLLM, not of the artifact)."""


NO_INT4_WITHOUT_AVX512 = pytest.mark.xfail(
    not AVX512, raises=VllmKernelMissing, strict=True,
    reason="vLLM 0.32.0 CPU runs int4 weights on CPUWNA16LinearKernel, which calls torch.ops._C.cpu_gemm_wna16, an op only "
           "its AVX-512 builds register: without AVX-512 it loads _C_AVX2 and the first forward fails",
)


INT4_OP_MISSING = ("vLLM's CPU build here lacks torch.ops._C.cpu_gemm_wna16, which its int4 layers call: only its "
                   "AVX-512 builds register it")
INT4_OP_PROBE = """
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
print(hasattr(torch.ops._C, "cpu_gemm_wna16"))
"""


@functools.cache
def vllm_has_int4_kernel(vllm_python: Path) -> bool:
    """Whether vLLM's CPU build registers the op its int4 layers call, asked of its kernels without loading a model
    (about 10 s, where a model would take minutes to build and load before failing)."""
    run = subprocess.run([str(vllm_python), "-c", INT4_OP_PROBE], capture_output=True, text=True, env=os.environ | VLLM_ENV,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1] == "True"


def require_vllm_int4_kernel(vllm_python: Path, missing: type[Exception] | None = None) -> None:
    """Raises missing (VllmKernelMissing by default) where vLLM has no int4 CPU kernel: a test that needs one stops
    before its expensive setup, and one that ran on a vLLM gaining it would pass, which a strict xfail notices."""
    if not vllm_has_int4_kernel(vllm_python):
        raise (missing or VllmKernelMissing)(INT4_OP_MISSING)


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    if ours == theirs:
        return None
    return next((index for index, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def llmc_gap(artifact: Path, token_ids: list[int], dtype: str) -> float:
    """How far below llmc's most likely token, in logprob under llmc in dtype, the last of token_ids is."""
    from llmc.runtime.engine.config import EngineConfig
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    engine = LLM(artifact, EngineConfig(dtype=getattr(torch, dtype), max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.1))
    last = engine.generate([token_ids], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]["prompt_logprobs"][-1]
    return round(max(last.top_logprobs.values()) - last.logprob, 3)


def decisive_checkpoint(folder: Path, family: str, **config) -> Path:
    """A tiny random checkpoint (hidden 128, so heads of 32 that vLLM's CPU attention takes) whose final norm's gain
    is multiplied by 8 before quantizing, so logits are decisive: random tiny models otherwise sit on near-ties that
    any rounding difference between two engines' kernels flips, while a misread artifact still diverges from the first
    token."""
    from helpers import build_tiny_model
    from transformers import AutoModelForCausalLM

    from llmc.checkpoints.families import FAMILIES

    model = build_tiny_model(folder, family, hidden=128, seed=1, **config)
    hf = AutoModelForCausalLM.from_pretrained(model)
    gain = hf.model.norm.weight.data
    offset = FAMILIES[family].norm_offset
    gain.copy_((gain + offset) * 8 - offset)
    hf.save_pretrained(model)
    return model


def vllm_greedy_results(vllm_python: Path, artifacts: list[Path], prompts: list[list[int]], max_tokens: int, dtype: str,
                        folder: Path) -> dict[str, dict]:
    """vLLM's greedy tokens (or the error it stopped with) per artifact, by the artifact's parent folder's name, from
    one run of integration/vllm_greedy.py."""
    request = {"artifacts": [str(path) for path in artifacts], "prompts": prompts, "max_tokens": max_tokens,
               "max_model_len": MAX_MODEL_LEN, "dtype": dtype}
    (folder / "request.json").write_text(json.dumps(request))
    with open(folder / "vllm.log", "w") as log:
        run = subprocess.run([str(vllm_python), str(Path(__file__).parent / "integration" / "vllm_greedy.py"),
                              str(folder / "request.json"), str(folder / "results.jsonl")], stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=os.environ | VLLM_ENV | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                             timeout=1200)
    assert run.returncode == 0, (folder / "vllm.log").read_text()[-5000:]
    results = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    return {Path(result["artifact"]).parent.name: result for result in results}
