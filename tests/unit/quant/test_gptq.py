import json
from pathlib import Path

import pytest
import torch
from helpers import first_layer, write_recipe
from transformers import AutoModelForCausalLM

from llmc.calib.driver import layer_linears
from llmc.checkpoints.families import family_for
from llmc.core.errors import LlmcError
from llmc.evals.loading import load_model
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.quant.gptq import GPTQRun, GPTQStage, gptq_quantize
from llmc.quant.layer import LayerRunner, LayerWork, recording
from llmc.quant.qtypes import QuantArgs, quantize_weight

FORMATS = {
    "w4-sym-g32": QuantArgs(num_bits=4, strategy="group", group_size=32),
    "w4-asym-g32": QuantArgs(num_bits=4, symmetric=False, strategy="group", group_size=32),
    "w4-sym-g32-static": QuantArgs(num_bits=4, strategy="group", group_size=32, actorder="static"),
    "w4-sym-g32-group": QuantArgs(num_bits=4, strategy="group", group_size=32, actorder="group"),
    "w8-sym-channel": QuantArgs(num_bits=8, strategy="channel"),
    "w4-asym-tensor": QuantArgs(num_bits=4, symmetric=False, strategy="tensor"),
    "w4-asym-g32-mse": QuantArgs(num_bits=4, symmetric=False, strategy="group", group_size=32, observer="mse"),
    "w4-sym-g32-static-mse": QuantArgs(num_bits=4, strategy="group", group_size=32, actorder="static", observer="mse"),
}


def correlated_inputs(tokens=512, columns=128, seed=0):
    """Inputs with correlated channels of very different magnitudes, like a transformer's hidden states."""
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(columns, columns, generator=generator) / columns**0.5 + torch.eye(columns)
    magnitudes = torch.exp(torch.randn(columns, generator=generator))
    return torch.randn(tokens, columns, generator=generator) @ mixing * magnitudes


def hessian_of(inputs):
    return 2 * inputs.T @ inputs / inputs.shape[0]


def output_error(weight, dequantized, inputs):
    return float((inputs @ (weight - dequantized).T).pow(2).sum())


@pytest.mark.parametrize("name", FORMATS)
def test_gptq_beats_round_to_nearest_on_output_error(name):
    args = FORMATS[name]
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    inputs = correlated_inputs()
    gptq = gptq_quantize(weight, hessian_of(inputs), args, block_size=64)
    rtn = quantize_weight(weight, args)
    assert gptq.codes.dtype == torch.int8 and args.qmin <= int(gptq.codes.min()) <= int(gptq.codes.max()) <= args.qmax
    assert output_error(weight, gptq.dequantize(), inputs) < 0.8 * output_error(weight, rtn.dequantize(), inputs)
    assert (gptq.g_idx is not None) == (args.actorder == "group")


@pytest.mark.parametrize(
    "name", ["w4-sym-g32", "w4-asym-g32", "w4-sym-g32-static", "w8-sym-channel", "w4-asym-g32-mse", "w4-sym-g32-static-mse"]
)
def test_without_error_propagation_gptq_is_round_to_nearest(name):
    """A diagonal Hessian couples no columns: nothing propagates, and GPTQ must reproduce RTN exactly."""
    args = FORMATS[name]
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(2))
    hessian = torch.diag(torch.rand(128, generator=torch.Generator().manual_seed(3)) + 0.5)
    gptq, rtn = gptq_quantize(weight, hessian, args), quantize_weight(weight, args)
    assert torch.equal(gptq.codes, rtn.codes)
    assert torch.equal(gptq.scale, rtn.scale) and torch.equal(gptq.zero_point, rtn.zero_point)


def test_act_order_group_index_maps_columns_to_their_scales():
    args = FORMATS["w4-sym-g32-group"]
    weight = torch.randn(8, 128, generator=torch.Generator().manual_seed(4))
    inputs = correlated_inputs(seed=5)
    quantized = gptq_quantize(weight, hessian_of(inputs), args)
    order = torch.argsort(torch.diagonal(hessian_of(inputs)), descending=True)
    assert torch.equal(quantized.g_idx[order], torch.arange(128, dtype=torch.int32) // 32)
    assert torch.bincount(quantized.g_idx).tolist() == [32, 32, 32, 32]
    # each column lies within half a step of its group's grid
    step = quantized.scale[:, quantized.g_idx]
    assert ((quantized.dequantize() - torch.round(quantized.dequantize() / step) * step).abs() < 1e-5).all()


def test_non_positive_definite_hessian_raises_dampening_with_a_warning():
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(6))
    hessian = torch.eye(64)
    hessian[0, 0] = -0.05  # the mean diagonal is ~1: dampening 0.01 is too little, 0.1 enough
    with pytest.warns(UserWarning, match="not positive definite with dampening 0.01; retrying with 0.1"):
        quantized = gptq_quantize(weight, hessian, FORMATS["w4-sym-g32"], name="q_proj")
    assert torch.isfinite(quantized.dequantize()).all()
    with pytest.warns(UserWarning, match="no usable Hessian"):
        broken = gptq_quantize(weight, torch.full((64, 64), float("nan")), FORMATS["w4-sym-g32"])
    assert torch.equal(broken.codes, quantize_weight(weight, FORMATS["w4-sym-g32"]).codes)


def test_dead_inputs_keep_their_weights_and_never_produce_nan():
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(7))
    inputs = correlated_inputs(256, 64, seed=8)
    inputs[:, [3, 40]] = 0
    for args in (FORMATS["w4-asym-g32"], FORMATS["w4-sym-g32-group"]):
        quantized = gptq_quantize(weight, hessian_of(inputs), args)
        dequantized = quantized.dequantize()
        assert torch.isfinite(dequantized).all()
        step = quantized.scale.max()
        assert ((dequantized[:, [3, 40]] - weight[:, [3, 40]]).abs() <= step).all()


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_hessians_are_shared_by_linears_that_read_the_same_input(tiny_llama, compute_dtype):
    setup = first_layer(tiny_llama, num_samples=5, seq_len=16, seed=0)
    config, skeleton, layer, hidden = setup.config, setup.skeleton, setup.layer, setup.hidden
    runner = LayerRunner(skeleton, config, seq_len=16, batch_size=2, compute_dtype=compute_dtype)
    stage = GPTQRun(GPTQStage(type="gptq"), torch.float32, family_for(config))
    work = LayerWork(layer, "model.layers.0", layer_linears(layer, "model.layers.0"), {}, runner)
    with recording(stage.observed_modules(work), stage.record):
        runner(layer, hidden)
    prefix = "model.layers.0."
    assert sorted(stage.sums) == [prefix + n for n in ("mlp.down_proj", "mlp.gate_proj", "self_attn.o_proj", "self_attn.q_proj")]
    assert stage.owner[prefix + "self_attn.v_proj"] == prefix + "self_attn.q_proj"
    assert stage.owner[prefix + "mlp.up_proj"] == prefix + "mlp.gate_proj"
    normed = layer.input_layernorm(hidden).reshape(-1, config.hidden_size)
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if compute_dtype == torch.float32 else {"rtol": 0.03, "atol": 0.03}
    torch.testing.assert_close(stage.hessian(prefix + "self_attn.k_proj"), hessian_of(normed), **tolerance)
    assert all(parameter.dtype == torch.float32 for parameter in layer.parameters())


GPTQ_STAGE = "  - type: gptq\n    scheme: W4A16\n    weights: {{group_size: 32{extra}}}\n"
RTN_STAGE = "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n"


def quantize(tmp_path, model, stage, calibration, name):
    recipe = load_recipe(write_recipe(tmp_path / f"{name}.yaml", model, tmp_path / name, stage, calibration))
    return run_quantize(recipe)


def layer_errors(artifact):
    return [layer["output_error"] for layer in json.loads((artifact / "llmc.json").read_text())["layers"]]


@pytest.mark.parametrize("actorder", [None, "static"])
def test_gptq_artifact_loads_in_transformers_and_beats_rtn(tmp_path, tiny_llama, calib_file, actorder):
    extra = f", actorder: {actorder}" if actorder else ""
    artifact = quantize(tmp_path, tiny_llama, GPTQ_STAGE.format(extra=extra), calib_file, "gptq")
    rtn = quantize(tmp_path, tiny_llama, RTN_STAGE, calib_file, "rtn")
    assert all(g < r for g, r in zip(layer_errors(artifact), layer_errors(rtn)))
    weights = json.loads((artifact / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert weights.get("actorder") == actorder
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = load_model(str(artifact)).model(ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_act_order_group_is_refused_for_compressed_tensors(tmp_path, tiny_llama, calib_file):
    stage = GPTQ_STAGE.format(extra=", actorder: group")
    with pytest.raises(LlmcError, match="stages.0.weights.actorder: 'group' needs a g_idx tensor"):
        load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", stage, calib_file))


def test_stacking_linears_that_share_a_hessian_changes_nothing():
    args = FORMATS["w4-asym-g32"]
    generator = torch.Generator().manual_seed(9)
    first, second = torch.randn(16, 64, generator=generator), torch.randn(8, 64, generator=generator)
    hessian = hessian_of(correlated_inputs(256, 64, seed=10))
    stacked = gptq_quantize(torch.cat([first, second]), hessian, args)
    for part, weight in ((stacked.rows(0, 16), first), (stacked.rows(16, 24), second)):
        alone = gptq_quantize(weight, hessian, args)
        assert torch.equal(part.codes, alone.codes) and torch.equal(part.scale, alone.scale)


def test_act_order_without_a_hessian_is_refused(tmp_path, tiny_llama):
    stage = "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32, actorder: static}\n"
    with pytest.raises(LlmcError, match="stages.0: weights.actorder needs a Hessian; use type: gptq"):
        load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", stage))
    with pytest.raises(LlmcError, match="stages.0 \\(gptq\\) needs a calibration section"):
        load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", GPTQ_STAGE.format(extra="")))


@pytest.mark.parametrize("name", ["smollm2-w4a16-gptq", "smollm2-w4a16-awq", "smollm2-w4a16-awq-gptq"])
def test_shipped_gptq_and_awq_recipes_use_group_size_64(name):
    recipe = load_recipe(Path(__file__).resolve().parents[3] / "recipes" / f"{name}.yaml")
    assert all(stage.weights.group_size in (None, 64) for stage in recipe.stages if hasattr(stage, "weights"))
