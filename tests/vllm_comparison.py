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

from llmc.runtime.engine.config import native_bfloat16

VLLM_VENV = Path(os.environ.get("LLMC_VLLM_VENV", Path(__file__).resolve().parents[1] / ".vllm-venv"))
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
NEAR_TIE = 1.0  # nats: a misread artifact's tokens are far less likely than this under the artifact as llmc reads it
MAX_MODEL_LEN = 256
AMX = torch.cpu._is_amx_tile_supported()
# the engines run bfloat16 where the CPU multiplies it natively (AVX-512 BF16, AMX), else float32: bfloat16 is emulated
# there, and float32 is llmc's exact path
DTYPE = "bfloat16" if native_bfloat16("cpu") else "float32"
MISSING_KERNEL = re.compile(r"has no attribute 'cpu_gemm_wna16'|\"cpu_gemm_wna16\" not implemented for 'Float'|"
                            r"Failed to find a kernel that can implement the WNA16 linear layer")


class VllmKernelMissing(Exception):
    """vLLM's CPU build has no kernel for the artifact's format (a limit of vLLM, not of the artifact)."""


INT4_OP_MISSING = ("vLLM 0.32.0's CPU build runs int4 layers on torch.ops._C.cpu_gemm_wna16, which takes bfloat16 and "
                   "float16 inputs only (its AVX2 builds of some wheels lack the op altogether); without native "
                   "bfloat16 the tests run float32, where the first forward fails")
NO_INT4_KERNEL = pytest.mark.xfail(DTYPE == "float32", raises=VllmKernelMissing, strict=True, reason=INT4_OP_MISSING)
INT4_OP_PROBE = """
import sys
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
if not hasattr(torch.ops._C, "cpu_gemm_wna16"):
    print(False)
elif sys.argv[1] == "float32":  # the op dispatches on the inputs' dtype before it reads any tensor
    try:
        torch.ops._C.cpu_gemm_wna16(torch.zeros(1, 128), torch.zeros(16, 64, dtype=torch.int32), torch.empty(1, 64),
                                    torch.ones(2, 64), None, None, 8, "vec")
        print(True)
    except NotImplementedError:
        print(False)
else:
    print(True)
"""


@functools.cache
def vllm_has_int4_kernel(vllm_python: Path) -> bool:
    """Whether vLLM's CPU build runs int4 layers in the tests' dtype, asked of its kernels without loading a model
    (about 10 s, where a model would take minutes to build and load before failing)."""
    run = subprocess.run([str(vllm_python), "-c", INT4_OP_PROBE, DTYPE], capture_output=True, text=True, env=os.environ | VLLM_ENV,
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


def assert_same_up_to_near_ties(artifact: Path, prompts: list[list[int]], ours: list[list[int]], theirs: list[list[int]],
                                label: str) -> None:
    """llmc's and vLLM's greedy tokens on the same prompts agree: all but one prompt identical and that one to its 8th
    token, or else every divergence a near-tie under llmc (the engines' bfloat16 kernels round differently). A misread
    artifact diverges from the first token."""
    divergences = [first_divergence(mine, other) for mine, other in zip(ours, theirs)]
    print(f"\n{label}: first divergence per prompt {divergences}")
    if divergences.count(None) >= len(prompts) - 1 and all(index is None or index >= 8 for index in divergences):
        return
    gaps = [llmc_gap(artifact, prompt + other[: index + 1], DTYPE) for prompt, other, index in zip(prompts, theirs, divergences)
            if index is not None]
    print(f"{label}: at each divergence, vLLM's token is {gaps} nats below llmc's choice under llmc")
    assert max(gaps) <= NEAR_TIE, (divergences, gaps)


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
