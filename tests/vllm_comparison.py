"""Plain code the tests that run vLLM share: where its venv is, how it is run, and how llmc's greedy tokens are held
against vLLM's (the fixtures that build the venv are in tests/integration/conftest.py)."""
import os
import re
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
