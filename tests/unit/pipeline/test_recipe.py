from pathlib import Path

import pytest
from helpers import load_shipped

from llmc.core.errors import LlmcError
from llmc.pipeline.recipe import load_recipe

GOOD = """\
model: smollm2-135m
output: artifacts/x
calibration:
  num_samples: 8
stages:
  - type: rtn
    scheme: W4A16
    weights:
      group_size: 64
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def error_of(path: Path, overrides=()) -> str:
    with pytest.raises(LlmcError) as info:
        load_recipe(path, list(overrides))
    return str(info.value)


def test_preset_with_overrides(tmp_path):
    recipe = load_recipe(write(tmp_path, GOOD))
    weights = recipe.stages[0].weights
    assert (weights.num_bits, weights.symmetric, weights.strategy, weights.group_size) == (4, True, "group", 64)
    assert recipe.calibration.num_samples == 8 and recipe.calibration.seq_len == 512


def test_set_overrides_and_output(tmp_path):
    recipe = load_recipe(
        write(tmp_path, GOOD),
        ["calibration.num_samples=16", "stages.0.weights.symmetric=false", "eval.perplexity.dataset=wikitext2"],
        output="elsewhere",
    )
    assert recipe.calibration.num_samples == 16
    assert recipe.stages[0].weights.symmetric is False
    assert recipe.eval.perplexity.dataset == "wikitext2"
    assert recipe.output == "elsewhere"


def test_resolved_recipe_round_trips(tmp_path):
    recipe = load_recipe(write(tmp_path, GOOD))
    again = load_recipe(write(tmp_path, recipe.to_yaml()))
    assert again == recipe


def test_unknown_key_names_path_and_line(tmp_path):
    message = error_of(write(tmp_path, GOOD.replace("    weights:", "    wieghts: 1\n    weights:")))
    assert "line 8: stages.0.wieghts: unknown key" in message


def test_bad_value_names_path_and_line(tmp_path):
    message = error_of(write(tmp_path, GOOD.replace("group_size: 64", "group_size: 64\n      num_bits: 5")))
    assert "line 10: stages.0.weights.num_bits: Input should be 2, 3, 4 or 8" in message


def test_unknown_top_level_section(tmp_path):
    assert "line 10: kv_cahce: unknown key" in error_of(write(tmp_path, GOOD + "kv_cahce: {dtype: fp8}\n"))


def test_unknown_stage_type(tmp_path):
    message = error_of(write(tmp_path, GOOD.replace("type: rtn", "type: magic")))
    assert "line 6: stages.0" in message and "rtn" in message


def test_unknown_scheme(tmp_path):
    assert "unknown scheme 'W5A16'" in error_of(write(tmp_path, GOOD.replace("W4A16", "W5A16")))


def test_bad_override_is_attributed_to_set(tmp_path):
    message = error_of(write(tmp_path, GOOD), ["calibration.num_samples=0"])
    assert "--set: calibration.num_samples: Input should be greater than 0" in message
    assert "expects key.path=value" in error_of(write(tmp_path, GOOD), ["calibration.num_samples"])
    assert "list index below 1" in error_of(write(tmp_path, GOOD), ["stages.3.type=rtn"])


def test_missing_required_fields(tmp_path):
    message = error_of(write(tmp_path, "model: smollm2-135m\n"))
    assert "output: Field required" in message and "stages: Field required" in message


def test_not_yaml_and_not_a_mapping(tmp_path):
    assert "not valid YAML" in error_of(write(tmp_path, "model: [unclosed\n"))
    assert "YAML mapping" in error_of(write(tmp_path, "- a\n- b\n"))
    assert "cannot read recipe" in error_of(tmp_path / "missing.yaml")


def test_every_shipped_recipe_loads():
    for path in sorted(Path(__file__).resolve().parents[3].joinpath("recipes").glob("*.yaml")):
        load_shipped(path)
