import json

import pytest
import torch
from helpers import build_tiny_model, write_recipe
from transformers import AutoModelForCausalLM

from llmc.artifact.reader import layout_of, runtime_quantization
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.core.errors import LlmcError
from llmc.evals.loading import load_model
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.quant.quantized_mm import quantized_linear

Q_PROJ = "model.layers.0.self_attn.q_proj"
SCHEMES = {  # stages, compressed-tensors format, weight dtype, weight_scale shape of q_proj [128 x 128]
    "w8a8-dynamic": ("  - type: rtn\n    scheme: W8A8\n", "int-quantized", torch.int8, (128, 1)),
    "w8a8-static": (
        "  - type: gptq\n    scheme: W8A8\n    input_activations: {strategy: tensor, dynamic: false}\n",
        "int-quantized", torch.int8, (128, 1),
    ),
    "fp8-dynamic": ("  - type: rtn\n    scheme: FP8_DYNAMIC\n", "float-quantized", torch.float8_e4m3fn, (128, 1)),
    "fp8-static": ("  - type: rtn\n    scheme: FP8\n", "float-quantized", torch.float8_e4m3fn, (1,)),
    "fp8-block": ("  - type: rtn\n    scheme: FP8_BLOCK\n", "float-quantized", torch.float8_e4m3fn, (1, 1)),
}


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """Widths that 128 x 128 FP8 blocks divide, as compressed-tensors' loader requires."""
    return build_tiny_model(tmp_path_factory.mktemp("wide-llama"), hidden=128)


def quantize(tmp_path, model, stages, calibration):
    return run_quantize(load_recipe(write_recipe(tmp_path / "r.yaml", model, tmp_path / "art", stages, calibration)))


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("scheme", SCHEMES)
def test_export_layout_and_transformers_agree(tmp_path, wide_llama, calib_file, scheme):
    stages, fmt, dtype, scale_shape = SCHEMES[scheme]
    artifact = quantize(tmp_path, wide_llama, stages, calib_file)
    config = json.loads((artifact / "config.json").read_text())["quantization_config"]
    group = config["config_groups"]["group_0"]
    assert config["format"] == group["format"] == fmt and config["ignore"] == ["lm_head"]
    static = not group["input_activations"]["dynamic"]
    reader = CheckpointReader(artifact)
    assert reader.tensor(f"{Q_PROJ}.weight").dtype == dtype
    assert tuple(reader.tensor(f"{Q_PROJ}.weight_scale").shape) == scale_shape
    assert (f"{Q_PROJ}.input_scale" in reader.file_of) == static
    assert f"{Q_PROJ}.weight_packed" not in reader.file_of

    ours = load_model(str(artifact)).model
    ids = torch.randint(0, ours.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    emulated = logits(ours, ids)
    # compressed-tensors, inside transformers, decompresses the weights and quantizes the inputs itself
    hf = AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32)
    torch.testing.assert_close(logits(hf, ids), emulated, atol=1e-4, rtol=1e-4)
    for module in ours.modules():  # without the activation quantization the outputs differ: it is emulated
        module._forward_pre_hooks.clear()
    assert not torch.allclose(logits(ours, ids), emulated, atol=1e-4)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_cpu_kernel_path_matches_fake_quantized_path(tmp_path, wide_llama, calib_file, scheme):
    artifact = quantize(tmp_path, wide_llama, SCHEMES[scheme][0], calib_file)
    model = load_model(str(artifact)).model
    config = json.loads((artifact / "config.json").read_text())["quantization_config"]
    weight = layout_of(config).read(CheckpointReader(artifact), Q_PROJ)
    inputs, static_scale = runtime_quantization(artifact).inputs[Q_PROJ]
    weight.input_activations = inputs
    x = torch.randn(3, 9, 128, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fake_quantized = model.get_submodule(Q_PROJ)(x)
    torch.testing.assert_close(quantized_linear(x, weight, static_scale), fake_quantized, atol=1e-5, rtol=1e-5)


def test_dynamic_fp8_needs_no_calibration(tmp_path, tiny_llama):
    artifact = quantize(tmp_path, tiny_llama, SCHEMES["fp8-dynamic"][0], None)
    manifest = json.loads((artifact / "llmc.json").read_text())
    assert manifest["calibration"] is None
    assert manifest["stages"][0]["input_activations"] == "fp8 sym token dynamic"


def test_mixed_formats_are_mixed_precision(tmp_path, tiny_llama, calib_file):
    stages = (
        "  - type: rtn\n    scheme: W8A8\n    targets: ['re:.*self_attn.*']\n"
        "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n    targets: ['re:.*mlp.*']\n"
    )
    artifact = quantize(tmp_path, tiny_llama, stages, calib_file)
    config = json.loads((artifact / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    assert sorted(group["format"] for group in config["config_groups"].values()) == ["int-quantized", "pack-quantized"]
    hf = AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32)
    ids = torch.randint(0, hf.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(hf, ids), logits(load_model(str(artifact)).model, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("stages, message", [
    ("  - type: rtn\n    scheme: FP8\n", r"line 4: stages.0 \(rtn\) needs a calibration section: static input_activations"),
    ("  - type: rtn\n    scheme: W2A16\n    input_activations: {num_bits: 8, strategy: token, dynamic: true}\n",
     "line 4: stages.0: input_activations: 8-bit inputs take int4 or 8-bit weights"),
    ("  - type: rtn\n    scheme: W8A8\n    input_activations: {dynamic: false}\n", "strategy 'token' needs dynamic: true"),
    ("  - type: rtn\n    weights: {num_bits: 4, type: float}\n", "float4 E2M1 is NVFP4"),
    ("  - type: gptq\n    scheme: FP8_BLOCK\n", "GPTQ walks columns and cannot fix 2-D block scales"),
])
def test_activation_recipe_mistakes(tmp_path, tiny_llama, stages, message):
    with pytest.raises(LlmcError, match=message):
        load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", stages))


def test_legacy_exports_refuse_activation_quantization(tmp_path, tiny_llama):
    path = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", "  - type: rtn\n    scheme: W8A8\n")
    path.write_text(path.read_text() + "export: {format: gptq}\n")
    with pytest.raises(LlmcError, match="export.format gptq: holds int weight-only formats"):
        load_recipe(path)


def test_cli_says_dynamic_fp8_is_data_free(tmp_path, tiny_llama):
    from click.testing import CliRunner

    from llmc.cli import cli

    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "art", SCHEMES["fp8-dynamic"][0])
    result = CliRunner().invoke(cli, ["quantize", str(recipe)])
    assert result.exit_code == 0, result.output
    assert "data-free: no stage of r.yaml needs calibration data" in result.output
