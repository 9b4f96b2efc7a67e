import json

import pytest
import torch
from helpers import write_recipe
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmc.calib.data import load_calibration
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.core.errors import LlmcError
from llmc.evals.loading import load_model
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.quant.kvcache import KV_ATTENTION

ATTENTION = "model.layers.1.self_attn"


def kv_artifact(tmp_path, model, calibration, kv_cache: str, stages: str = " []\n"):
    path = write_recipe(tmp_path / "r.yaml", model, tmp_path / "art", "", calibration)
    path.write_text(path.read_text().replace("stages:\n", f"stages:{stages}") + f"kv_cache: {kv_cache}\n")
    return run_quantize(load_recipe(path))


def observed_keys_and_values(model_folder, calibration_ids):
    """K after the rotary embedding and V, as attention receives them, on the calibration samples."""
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    model.set_attn_implementation(KV_ATTENTION)
    seen = []
    model.get_submodule(ATTENTION).kv_hook = lambda key, value: seen.append((key, value)) or (key, value)
    with torch.no_grad():
        model(calibration_ids)
    return seen[0]


@pytest.mark.parametrize("dtype, strategy", [("fp8", "tensor"), ("int8", "head")])
def test_scales_are_calibrated_from_keys_and_values(tmp_path, tiny_llama, calib_file, dtype, strategy):
    artifact = kv_artifact(tmp_path, tiny_llama, calib_file, f"{{dtype: {dtype}, strategy: {strategy}}}")
    config = json.loads((artifact / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"]["type"] == ("float" if dtype == "fp8" else "int")
    assert config["kv_cache_scheme"]["strategy"] == ("tensor" if strategy == "tensor" else "attn_head")
    assert config["config_groups"] == {}
    reader = CheckpointReader(artifact)
    recipe = load_recipe(artifact / "recipe.yaml")
    ids = load_calibration(recipe.calibration, AutoTokenizer.from_pretrained(tiny_llama)).input_ids
    key, value = observed_keys_and_values(tiny_llama, ids)
    qmax = 448.0 if dtype == "fp8" else 127.5  # symmetric int8: absmax / ((127 - -128) / 2)
    for states, name in ((key, "k_scale"), (value, "v_scale")):
        absmax = states.abs().amax() if strategy == "tensor" else states.abs().amax(dim=(0, 2, 3)).reshape(-1, 1, 1)
        expected = (absmax / qmax).reshape(absmax.shape if strategy == "head" else (1,))
        torch.testing.assert_close(reader.tensor(f"{ATTENTION}.{name}"), expected)
    assert reader.tensor(f"{ATTENTION}.k_scale").shape == ((1,) if strategy == "tensor" else (2, 1, 1))


def test_evaluation_runs_attention_on_quantized_keys_and_values(tmp_path, tiny_llama, calib_file):
    artifact = kv_artifact(tmp_path, tiny_llama, calib_file, "{dtype: int8}")
    loaded = load_model(str(artifact)).model
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(0, reference.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, quantized = reference(ids).logits, loaded(ids).logits
        assert not torch.allclose(quantized, expected, atol=1e-6)
        assert (quantized - expected).pow(2).mean() < 1e-3 * expected.pow(2).mean()
        for layer in loaded.model.layers:
            del layer.self_attn.kv_hook
        torch.testing.assert_close(loaded(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_kv_cache_composes_with_weight_quantization(tmp_path, tiny_llama, calib_file):
    artifact = kv_artifact(tmp_path, tiny_llama, calib_file, "{dtype: fp8}", "\n  - type: rtn\n    scheme: FP8_DYNAMIC\n")
    config = json.loads((artifact / "config.json").read_text())["quantization_config"]
    assert config["format"] == "float-quantized" and config["kv_cache_scheme"]["num_bits"] == 8
    assert {f"model.layers.{i}.self_attn.{n}" for i in (0, 1) for n in ("k_scale", "v_scale")} <= set(CheckpointReader(artifact).file_of)
    assert load_model(str(artifact)).model.model.layers[0].self_attn.kv_hook is not None
    from rich.console import Console

    from llmc.pipeline.inspect_artifact import describe_artifact, print_artifact

    info = describe_artifact(artifact)
    assert info["input_activations"]["group_0"]["strategy"] == "token" and info["kv_cache_scheme"]["type"] == "float"
    console = Console(record=True, width=200)
    print_artifact(info, console)
    text = console.export_text()
    assert "float8 token dynamic" in text and "KV cache: float8, one scale per tensor" in text


def test_kv_cache_needs_calibration(tmp_path, tiny_llama):
    path = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "art", " []\n")
    path.write_text(path.read_text().replace("stages:\n", "stages:") + "kv_cache: {dtype: fp8}\n")
    with pytest.raises(LlmcError, match="line 4: kv_cache needs a calibration section"):
        load_recipe(path)
    path.write_text(path.read_text().replace("kv_cache: {dtype: fp8}\n", ""))
    with pytest.raises(LlmcError, match="stages: list at least one stage"):
        load_recipe(path)


def test_nvfp4_kv_cache_is_written_as_compressed_tensors_defines_it(tmp_path, tiny_llama, calib_file):
    """kv_cache: {dtype: nvfp4}: the NVFP4 preset's input activation arguments as kv_cache_scheme, and per attention
    module the global scales compressed-tensors computes from the keys' and values' range (its generate_gparam)."""
    from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme
    from compressed_tensors.quantization.utils import generate_gparam

    artifact = kv_artifact(tmp_path, tiny_llama, calib_file, "{dtype: nvfp4}")
    config = json.loads((artifact / "config.json").read_text())["quantization_config"]
    written, preset = QuantizationArgs(**config["kv_cache_scheme"]), preset_name_to_scheme("NVFP4", ["Linear"]).input_activations
    fields = ["num_bits", "type", "symmetric", "group_size", "strategy", "dynamic", "scale_dtype"]
    assert {name: getattr(written, name) for name in fields} == {name: getattr(preset, name) for name in fields}
    reader = CheckpointReader(artifact)
    assert not {name for name in reader.file_of if name.endswith((".k_scale", ".v_scale"))}
    recipe = load_recipe(artifact / "recipe.yaml")
    ids = load_calibration(recipe.calibration, AutoTokenizer.from_pretrained(tiny_llama)).input_ids
    key, value = observed_keys_and_values(tiny_llama, ids)
    for states, name in ((key, "k_global_scale"), (value, "v_global_scale")):
        absmax = states.abs().amax()
        torch.testing.assert_close(reader.tensor(f"{ATTENTION}.{name}"), generate_gparam(-absmax, absmax).reshape(1))
    loaded = load_model(str(artifact)).model  # evaluation rounds keys and values as NVFP4 stores them
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(0, reference.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, quantized = reference(ids).logits, loaded(ids).logits
    assert not torch.allclose(quantized, expected, atol=1e-4)
    assert (quantized - expected).pow(2).mean() < 0.05 * expected.pow(2).mean()


def test_nvfp4_kv_cache_has_one_global_scale_per_tensor(tmp_path, tiny_llama, calib_file):
    path = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "art", " []\n", calib_file)
    path.write_text(path.read_text().replace("stages:\n", "stages:") + "kv_cache: {dtype: nvfp4, strategy: head}\n")
    with pytest.raises(LlmcError, match="kv_cache.strategy head: nvfp4 has one global scale per tensor"):
        load_recipe(path)
