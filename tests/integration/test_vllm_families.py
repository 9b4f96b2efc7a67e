"""vLLM reads llmc's W4A16 artifacts of the families beyond Llama: tiny random checkpoints of Qwen3, Gemma 2 (soft caps,
alternating sliding windows shorter than the generation) and the mixture-of-experts families, quantized by llmc, are
loaded by vLLM's CPU build (the venv of test_vllm_compat.py) and its greedy tokens compared with llmc's runtime on the
same prompt token ids. The final norm's gain is multiplied by 8 before quantizing, so logits are decisive: random
tiny models otherwise sit on near-ties that any rounding difference between two engines' kernels flips, while a
misread artifact still diverges from the first token."""
from pathlib import Path

import pytest
import torch
from helpers import write_recipe
from vllm_comparison import (
    DTYPE,
    MISSING_KERNEL,
    NO_INT4_KERNEL,
    VllmKernelMissing,
    assert_same_up_to_near_ties,
    decisive_checkpoint,
    require_vllm_int4_kernel,
    vllm_greedy_results,
)

from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
FAMILY_CONFIGS = {
    "qwen3": dict(head_dim=32),
    "gemma2": dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                   attn_logit_softcapping=20.0, final_logit_softcapping=30.0, tie_word_embeddings=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128),
}
W4A16_G32 = "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n"
PROMPTS = [[5, 17, 42, 99, 3, 250], [7, 8, 9, 10, 11, 12, 13, 14, 15], [300, 200, 100], list(range(1, 21))]
MAX_TOKENS = 16
MOE_KERNEL_MISSING = "No WNA16 MoE backend supports the deployment configuration"


class VllmMoeKernelMissing(Exception):
    """vLLM's CPU build has no W4A16 MoE kernel for this CPU (a limit of vLLM, not of the artifact)."""


# vLLM 0.32.0's CPU backends for W4A16 experts: CPUExpertsInt4 (fused_moe/experts/cpu_moe.py) runs only where
# torch.cpu._is_amx_tile_supported(), ZEN_CPU needs zentorch, and the emulation backend refuses the CPU device
NO_CPU_MOE = pytest.mark.xfail(
    not torch.cpu._is_amx_tile_supported(), raises=VllmMoeKernelMissing, strict=True,
    reason="vLLM 0.32.0's only CPU kernel for W4A16 experts (CPUExpertsInt4) needs AMX; this CPU has none",
)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    built = {}
    for family in FAMILY_CONFIGS:
        folder = tmp_path_factory.mktemp(family)
        model = decisive_checkpoint(folder / "model", family, **FAMILY_CONFIGS[family])
        built[family] = run_quantize(load_recipe(write_recipe(folder / "recipe.yaml", model, folder / "w4a16", W4A16_G32)))
    return built


@pytest.fixture(scope="module")
def vllm_tokens(artifacts, vllm_python, tmp_path_factory) -> dict[str, dict]:
    return vllm_greedy_results(vllm_python, list(artifacts.values()), PROMPTS, MAX_TOKENS, DTYPE, tmp_path_factory.mktemp("vllm-families"))


@pytest.mark.parametrize("family", [pytest.param(family, marks=NO_CPU_MOE if family in ("mixtral", "qwen3_moe") else NO_INT4_KERNEL)
                                    for family in FAMILY_CONFIGS])
def test_vllm_loads_the_artifact_and_agrees_on_greedy_tokens(family, request, vllm_python):
    moe = family in ("mixtral", "qwen3_moe")
    require_vllm_int4_kernel(vllm_python, VllmMoeKernelMissing if moe else None)  # before building anything
    artifacts = request.getfixturevalue("artifacts")
    theirs = request.getfixturevalue("vllm_tokens")[artifacts[family].parent.name]
    if MOE_KERNEL_MISSING in theirs.get("error", ""):
        raise VllmMoeKernelMissing(theirs["error"])
    if MISSING_KERNEL.search(theirs.get("error", "")):
        raise VllmKernelMissing(theirs["error"])
    assert "error" not in theirs, f"vLLM could not run llmc's {family} artifact: {theirs.get('error')}"
    engine = LLM(str(artifacts[family]), EngineConfig(dtype=getattr(torch, DTYPE), max_model_len=256, kv_cache_gib=0.1))
    ours = [output["token_ids"] for output in engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                                      ignore_eos=True))]
    assert_same_up_to_near_ties(artifacts[family], PROMPTS, ours, theirs["token_ids"], family)
