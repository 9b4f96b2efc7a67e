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
from llmc.quant.layer import LayerRunner, LayerWork, recording
from llmc.quant.qtypes import QuantArgs
from llmc.quant.smoothquant import SmoothQuantRun, SmoothQuantStage

W8 = QuantArgs(num_bits=8, strategy="channel")
PREFIX = "model.layers.0"


def one_layer_model():
    config = AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), config


def hidden_with_outliers():
    hidden = torch.randn(6, 16, 64, generator=torch.Generator().manual_seed(1))
    hidden[..., [5, 17, 42]] *= 20  # a few channels with large activations, as in real LLMs
    return hidden


def smooth(layer, runner, hidden, alpha):
    linears = layer_linears(layer, PREFIX)
    transform = SmoothQuantRun(SmoothQuantStage(type="smoothquant", alpha=alpha), torch.float32,
                               family_for(AutoConfig.for_model("llama")))
    work = LayerWork(layer, PREFIX, linears, {name: W8 for name in linears}, runner)
    observed = transform.observed_modules(work)
    assert set(observed) == {"self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj"}  # v -> o skipped: grouped KV heads
    with recording(observed, transform.record):
        runner(layer, hidden)
    transform.process(work)


def input_range_spread(layer, runner, hidden) -> float:
    """max over channels / median over channels of max |input of q_proj|."""
    seen = []
    with recording({"q": layer.self_attn.q_proj}, lambda name, x: seen.append(x.abs().reshape(-1, 64).amax(0))):
        runner(layer, hidden)
    channel_max = torch.stack(seen).amax(0)
    return float(channel_max.max() / channel_max.median())


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_smoothing_leaves_the_full_precision_layer_unchanged_and_flattens_inputs(alpha):
    model, config = one_layer_model()
    layer = model.model.layers[0]
    runner = LayerRunner(model, config, seq_len=16, batch_size=4)
    hidden = hidden_with_outliers()
    before, spread_before = runner(layer, hidden), input_range_spread(layer, runner, hidden)
    norm_before = layer.input_layernorm.weight.detach().clone()
    smooth(layer, runner, hidden, alpha)
    assert not torch.allclose(layer.input_layernorm.weight, norm_before)
    torch.testing.assert_close(runner(layer, hidden), before, rtol=1e-4, atol=1e-4)
    assert input_range_spread(layer, runner, hidden) < spread_before / 2


def logits_error(artifact, reference, ids) -> float:
    with torch.no_grad():
        expected = reference(ids).logits
        return float((load_model(str(artifact)).model(ids).logits - expected).pow(2).mean() / expected.pow(2).mean())


def test_smoothquant_w8a8_beats_naive_w8a8_on_outlier_activations(tmp_path, calib_file):
    from helpers import build_tiny_model

    folder = build_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for layer in model.model.layers:  # outlier channels where the norms feed q/k/v and gate/up
        layer.input_layernorm.weight.data[[3, 30]] *= 40
        layer.post_attention_layernorm.weight.data[[7, 50]] *= 40
    model.save_pretrained(folder)
    errors = {}
    for name, stages in {
        "naive": "  - type: rtn\n    scheme: W8A8\n",
        "smoothquant": "  - type: smoothquant\n    alpha: 0.5\n  - type: rtn\n    scheme: W8A8\n",
        "smoothquant-gptq": "  - type: smoothquant\n  - type: gptq\n    scheme: W8A8\n",
    }.items():
        artifact = run_quantize(load_recipe(write_recipe(tmp_path / f"{name}.yaml", folder, tmp_path / name, stages, calib_file)))
        ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
        errors[name] = logits_error(artifact, model.eval(), ids)
    assert errors["smoothquant"] < errors["naive"] / 2
    assert errors["smoothquant-gptq"] < errors["naive"] / 2


@pytest.mark.parametrize("stages, message", [
    ("  - type: smoothquant\n", "stages.0 (smoothquant) must be followed by a stage that quantizes"),
    ("  - type: rtn\n    scheme: W8A8\n  - type: smoothquant\n", "stages.1 (smoothquant) must come before"),
    ("  - type: smoothquant\n    alpha: 1.5\n  - type: rtn\n    scheme: W8A8\n", "stages.0.alpha: Input should be less than or equal to 1"),
])
def test_smoothquant_recipe_mistakes(tmp_path, tiny_llama, calib_file, stages, message):
    with pytest.raises(LlmcError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", stages, calib_file))


def test_smoothquant_needs_calibration(tmp_path, tiny_llama):
    stages = "  - type: smoothquant\n  - type: rtn\n    scheme: W8A8\n"
    with pytest.raises(LlmcError, match=r"line 4: stages.0 \(smoothquant\) needs a calibration section"):
        load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", stages))
