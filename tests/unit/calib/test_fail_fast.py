"""Every input a recipe names is resolved before any weight is read: one that cannot be had stops the run with an
error naming its field and YAML line, and nothing is written."""
import pytest
from helpers import write_recipe

from llmc.checkpoints import hub
from llmc.core.errors import LlmcError
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe

STAGE = "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n"


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.hub_unreachable_reason.cache_clear()
    yield
    hub.hub_unreachable_reason.cache_clear()


def quantize_error(tmp_path, tiny_llama, calib_file, extra: str) -> str:
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", STAGE, calib_file)
    recipe.write_text(recipe.read_text() + extra)
    with pytest.raises(LlmcError) as error:
        run_quantize(load_recipe(recipe))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))
    return str(error.value)


def test_a_hub_data_set_offline_fails_before_any_weight_naming_field_and_line(tmp_path, tiny_llama, calib_file, offline, monkeypatch):
    import llmc.calib.driver

    monkeypatch.setattr(llmc.calib.driver, "quantize_layerwise", lambda *args: pytest.fail("weights were read"))
    message = quantize_error(tmp_path, tiny_llama, calib_file, "eval:\n  perplexity:\n    dataset: wikitext2\n")
    assert message.startswith("r.yaml line 13: eval.perplexity.dataset: perplexity data 'wikitext2' comes from the Hugging Face hub")
    assert "HF_HUB_OFFLINE" in message and "pass a local text file" in message


def test_missing_business_set_calibration_file_and_draft_prompts_name_their_fields(tmp_path, tiny_llama, calib_file):
    message = quantize_error(tmp_path, tiny_llama, calib_file, "eval:\n  business:\n    dataset: nowhere.jsonl\n")
    assert message.startswith("r.yaml line 13: eval.business.dataset: cannot read business eval set nowhere.jsonl")
    message = quantize_error(tmp_path, tiny_llama, tmp_path / "missing.jsonl", "")
    assert message.startswith("r.yaml line 4: calibration.dataset: calibration file not found")
    message = quantize_error(tmp_path, tiny_llama, calib_file, "draft:\n  prompts: [absent.jsonl]\n")
    assert message.startswith("r.yaml line 12: draft.prompts: prompt file not found: absent.jsonl")


def test_a_hub_calibration_set_offline_says_how_to_pass_a_file(tmp_path, tiny_llama, offline):
    message = quantize_error(tmp_path, tiny_llama, None, "calibration:\n  dataset: org/some-set\n")
    assert "calibration.dataset: calibration dataset 'org/some-set' comes from the Hugging Face hub" in message
    assert "pass a local .jsonl" in message
