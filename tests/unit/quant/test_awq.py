import pytest
import torch
from helpers import write_recipe
from transformers import AutoConfig, AutoModelForCausalLM

from llmc.calib.driver import layer_linears
from llmc.checkpoints.families import family_for
from llmc.core.errors import LlmcError
from llmc.evals.loading import load_model
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.quant.awq import AWQRun, AWQStage, search_clip
from llmc.quant.layer import LayerRunner, LayerWork, recording
from llmc.quant.qtypes import QuantArgs, fake_quantize

W4_G16 = QuantArgs(num_bits=4, strategy="group", group_size=16)
PREFIX = "model.layers.0"


def mha_model(num_kv_heads: int = 4):
    config = AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=num_kv_heads, max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), config


def hidden_with_outliers(seq_len=16):
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, seq_len, 64, generator=generator)
    hidden[..., [5, 17, 42]] *= 20  # a few channels with large activations, as in real LLMs
    return hidden


def run_awq(layer, runner, hidden, stage: AWQStage, num_kv_heads: int):
    linears = layer_linears(layer, PREFIX)
    awq = AWQRun(stage, torch.float32, family_for(AutoConfig.for_model("llama")))
    work = LayerWork(layer, PREFIX, linears, {name: W4_G16 for name in linears}, runner)
    observed = awq.observed_modules(work)
    assert len(observed) == (4 if num_kv_heads == 4 else 3)  # v -> o only when v's outputs match o's inputs
    with recording(observed, awq.record):
        runner(layer, hidden)
    awq.process(work)


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_folded_scales_leave_the_full_precision_layer_unchanged(num_kv_heads):
    model, config = mha_model(num_kv_heads)
    layer = model.model.layers[0]
    runner = LayerRunner(model, config, seq_len=16, batch_size=4)
    hidden = hidden_with_outliers()
    before = runner(layer, hidden)
    norm_before = layer.input_layernorm.weight.detach().clone()
    run_awq(layer, runner, hidden, AWQStage(type="awq"), num_kv_heads)
    assert not torch.allclose(layer.input_layernorm.weight, norm_before)  # something was actually scaled
    torch.testing.assert_close(runner(layer, hidden), before, rtol=1e-4, atol=1e-4)


def quantized_output_error(layer, runner, hidden, reference):
    originals = {name: linear.weight.data.clone() for name, linear in layer_linears(layer, PREFIX).items()}
    for linear in layer_linears(layer, PREFIX).values():
        linear.weight.data = fake_quantize(linear.weight.data, W4_G16)
    error = float((runner(layer, hidden) - reference).pow(2).mean())
    for name, linear in layer_linears(layer, PREFIX).items():
        linear.weight.data = originals[name]
    return error


@pytest.mark.parametrize("clip_search", [False, True])
def test_awq_lowers_the_quantized_layer_error(clip_search):
    model, config = mha_model()
    layer = model.model.layers[0]
    runner = LayerRunner(model, config, seq_len=16, batch_size=4)
    hidden = hidden_with_outliers()
    reference = runner(layer, hidden)
    rtn_error = quantized_output_error(layer, runner, hidden, reference)
    run_awq(layer, runner, hidden, AWQStage(type="awq", clip_search=clip_search), 4)
    assert quantized_output_error(layer, runner, hidden, reference) < 0.8 * rtn_error


def test_clip_search_never_does_worse_than_the_full_range():
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(24, 64, generator=generator)
    weight[:, 7] *= 8  # an outlier weight stretches its groups' ranges
    inputs = torch.randn(256, 64, generator=generator)
    clipped = search_clip(weight, inputs, W4_G16, n_grid=20, max_shrink=0.5)
    assert (clipped.abs() <= weight.abs()).all()
    per_group = lambda w: (inputs @ (fake_quantize(w, W4_G16) - weight).T).pow(2).sum()  # noqa: E731
    assert per_group(clipped) < per_group(weight)


AWQ = "  - type: awq\n"
RTN = "  - type: rtn\n    scheme: W4A16_ASYM\n    weights: {group_size: 32}\n"
GPTQ = "  - type: gptq\n    scheme: W4A16\n    weights: {group_size: 32, actorder: static}\n"


@pytest.mark.parametrize("stages", [AWQ + RTN, AWQ + GPTQ, AWQ + "    clip_search: true\n" + GPTQ])
def test_awq_composes_with_rtn_and_gptq_in_one_recipe(tmp_path, tiny_llama, calib_file, stages):
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "art", stages, calib_file))
    artifact = run_quantize(recipe)
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = load_model(str(artifact)).model(ids).logits
        original = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)(ids).logits
    assert torch.isfinite(ours).all()
    assert (ours - original).pow(2).mean() < 0.05 * original.pow(2).mean()
    if "ASYM" not in stages:  # transformers 5.24 cannot size packed asymmetric zero points (see test_artifact)
        hf = AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, ours, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stages, message", [
    (RTN + AWQ, "stages.1 (awq) must come before the stages that quantize"),
    (AWQ, "stages.0 (awq) must be followed by a stage that quantizes"),
])
def test_awq_order_is_checked(tmp_path, tiny_llama, calib_file, stages, message):
    with pytest.raises(LlmcError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "art", stages, calib_file))
