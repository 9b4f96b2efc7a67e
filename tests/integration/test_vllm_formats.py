"""Which of llmc's newer formats vLLM's CPU build serves, and the message with which it refuses the others: a tiny
Llama (decisive logits, see vllm_comparison.decisive_checkpoint) quantized by llmc in each preset, loaded by vLLM in one
process chain. A refusal is a strict xfail on its exact message, so a vLLM that gains a CPU kernel for the format is
noticed (the test then compares greedy tokens with llmc's instead). The GPU kernels vLLM picks for each format are
listed in docs/artifact-format.md."""
import re
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
    vllm_has_int4_kernel,
)

from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.integration]
PROMPTS = [[5, 17, 42, 99, 3, 250], list(range(1, 21))]
MAX_TOKENS = 8
# vLLM 0.32.0's CPU platform: its NVFP4, MXFP4 and MXFP8 kernel lists hold no CPU kernel (and NVFP4A16 forces
# Marlin's FP4, CUDA only); W4AFP8's scheme needs Hopper (compute capability 9.0); its CPU int kernels take int4
# and int8 only
REFUSALS = {
    "NVFP4A16": "Forced NVFP4 kernel MarlinNvFp4LinearKernel is not supported: Marlin FP4 not available",
    "NVFP4": "Failed to find a kernel that can implement the NVFP4 linear layer",
    "MXFP4": "Failed to find a kernel that can implement the MXFP4 linear layer",
    "MXFP8": "Failed to find a kernel that can implement the MXFP8 linear layer",
    "W4AFP8": "No compressed-tensors compatible scheme was found",
    "W3A16": "Unsupported quant type uint3b4",
    "W2A16": "Unsupported quant type uint2b2",
    # W8A8 weights (served on the CPU) with `kv_cache: {dtype: nvfp4}`: vLLM's compressed-tensors loader takes FP8 KV
    # schemes only; its own `--kv-cache-dtype nvfp4` computes the scales itself, from an artifact without the section
    "NVFP4-KV": "Currently supported kv cache quantization is num_bits=8, type=float, however received num_bits=4, type=float",
}
WITH_NVFP4_KV = {"NVFP4-KV": "W8A8"}  # refusal name: the weights' scheme
# on its int4 CPU kernel (CPUWNA16), in bfloat16 only (NO_INT4_KERNEL); MIXED: a mix as `llmc tune` writes them, one
# config group per format (W8A8 attention projections, W4A16 MLPs, o_proj unquantized)
SERVED = ["W4A8", "MIXED"]
MIXED_STAGES = ("  - type: rtn\n    scheme: W8A8\n    targets: ['re:.*self_attn\\.[qkv]_proj$']\n"
                "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n    targets: ['re:.*mlp\\.']\n")


class VllmRefuses(Exception):
    """vLLM's CPU build has no kernel or scheme for the format (a limit of vLLM, not of the artifact)."""


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, calib_file) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("vllm-formats")
    model = decisive_checkpoint(folder / "model", "llama")
    built = {}
    for scheme in [*REFUSALS, *SERVED]:
        weights = WITH_NVFP4_KV.get(scheme, scheme)
        group_size = "\n    weights: {group_size: 32}" if weights.startswith("W") and weights != "W8A8" else ""
        stage = MIXED_STAGES if scheme == "MIXED" else f"  - type: rtn\n    scheme: {weights}{group_size}\n"
        recipe = write_recipe(folder / f"{scheme}.yaml", model, folder / scheme / "artifact", stage, calib_file)
        if scheme in WITH_NVFP4_KV:
            recipe.write_text(recipe.read_text() + "kv_cache: {dtype: nvfp4}\n")
        built[scheme] = run_quantize(load_recipe(recipe))
    return built


@pytest.fixture(scope="module")
def vllm_results(artifacts, vllm_python, tmp_path_factory) -> dict[str, dict]:
    """Each artifact in vLLM, but W4A8's where vLLM has no int4 kernel here (test_vllm_serves_w4a8_as_llmc_does then
    stops on that before asking)."""
    served = [path for scheme, path in artifacts.items() if scheme in REFUSALS or vllm_has_int4_kernel(vllm_python)]
    return vllm_greedy_results(vllm_python, served, PROMPTS, MAX_TOKENS, DTYPE, tmp_path_factory.mktemp("vllm-formats-run"))


def assert_same_greedy_tokens(artifact: Path, theirs: list[list[int]]) -> None:
    engine = LLM(str(artifact), EngineConfig(dtype=getattr(torch, DTYPE), max_model_len=256, kv_cache_gib=0.1))
    ours = [output["token_ids"] for output in engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                                      ignore_eos=True))]
    assert_same_up_to_near_ties(artifact, PROMPTS, ours, theirs, artifact.parent.name)


@pytest.mark.parametrize("scheme", [pytest.param(scheme, marks=pytest.mark.xfail(raises=VllmRefuses, strict=True, reason=message))
                                    for scheme, message in REFUSALS.items()])
def test_vllm_refuses_the_formats_it_has_no_cpu_kernel_for(scheme, artifacts, vllm_results):
    result = vllm_results[scheme]
    if "error" in result:
        assert re.search(re.escape(REFUSALS[scheme]), result["error"]), f"{scheme}: vLLM stopped otherwise: {result['error']}"
        raise VllmRefuses(result["error"])
    assert_same_greedy_tokens(artifacts[scheme], result["token_ids"])  # a vLLM that serves it: then it must agree


@pytest.mark.parametrize("scheme", [pytest.param(scheme, marks=NO_INT4_KERNEL) for scheme in SERVED])
def test_vllm_serves_w4a8_and_a_tuned_mix_as_llmc_does(scheme, artifacts, vllm_python, request):
    require_vllm_int4_kernel(vllm_python)
    result = request.getfixturevalue("vllm_results")[scheme]
    if MISSING_KERNEL.search(result.get("error", "")):
        raise VllmKernelMissing(result["error"])
    assert "error" not in result, f"vLLM could not run llmc's {scheme} artifact: {result.get('error')}"
    assert_same_greedy_tokens(artifacts[scheme], result["token_ids"])
