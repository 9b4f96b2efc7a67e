import pytest
import torch
from helpers import build_tiny_model, first_layer, run_staggered, write_recipe
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from llmc.calib.driver import layer_linears
from llmc.checkpoints.families import LLAMA_LIKE
from llmc.evals.loading import load_model
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.quant.autoround import AutoRoundRun, AutoRoundStage, LearnedRounding
from llmc.quant.layer import LayerRunner, LayerWork, recording
from llmc.quant.qtypes import QuantArgs, QuantizedWeight, quantize_weight
from llmc.quant.rtn import RTNRun, RTNStage
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

PREFIX = "model.layers.0"


@pytest.mark.parametrize("args", [
    QuantArgs(num_bits=4, group_size=16), QuantArgs(num_bits=3, symmetric=False, group_size=16),
    QuantArgs(num_bits=2, symmetric=False, group_size=32), QuantArgs(num_bits=8, strategy="channel"),
])
def test_untrained_rounding_is_round_to_nearest(args):
    """Zero offsets and unit factors give exactly RTN's codes, scales and zero points, and the differentiable fake
    quantization equals what the artifact dequantizes to."""
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    learned = LearnedRounding(weight, args, torch.bfloat16, full_range=False).quantized()
    rtn = quantize_weight(weight, args, torch.bfloat16)
    assert torch.equal(learned.codes, rtn.codes)
    assert torch.equal(learned.scale, rtn.scale) and torch.equal(learned.zero_point, rtn.zero_point)
    in_float32 = QuantizedWeight(rtn.codes, rtn.scale.float(), rtn.zero_point, args).dequantize()
    torch.testing.assert_close(LearnedRounding(weight, args, torch.bfloat16, full_range=False).fake_quantized(), in_float32)


def test_full_range_puts_each_groups_largest_weight_on_the_lowest_code():
    args = QuantArgs(num_bits=4, group_size=16)
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    full = LearnedRounding(weight, args, torch.float32, full_range=True)
    quantized = full.quantized()
    groups = weight.reshape(32, 4, 16)
    largest = groups.abs().argmax(dim=-1, keepdim=True)
    assert (quantized.codes.reshape(32, 4, 16).gather(-1, largest) == -8).all()
    assert ((quantized.scale < 0) == (groups.gather(-1, largest)[..., 0] > 0)).all()  # negative where that weight is positive
    torch.testing.assert_close(full.fake_quantized(), quantized.dequantize())
    grid = LearnedRounding(weight, args, torch.float32, full_range=False).quantized().dequantize()
    assert ((quantized.dequantize() - weight) ** 2).mean() < ((grid - weight) ** 2).mean()


def layer_error(tmp_path, stage_config, run_type):
    model = build_tiny_model(tmp_path / "model", hidden=64, seed=1)
    first = first_layer(model, num_samples=8, seq_len=32, seed=2)
    runner = LayerRunner(first.skeleton, first.config, 32, batch_size=4)
    reference = runner(first.layer, first.hidden)
    linears = layer_linears(first.layer, PREFIX)
    run = run_type(stage_config, torch.float32, LLAMA_LIKE)
    work = LayerWork(first.layer, PREFIX, linears, {name: stage_config.weights for name in linears}, runner)
    observed = run.observed_modules(work)
    with recording(observed, run.record):
        runner(first.layer, first.hidden)
    results = run.process(work)
    assert set(results) == set(linears)
    out = runner(first.layer, first.hidden)
    return float(((out - reference) ** 2).sum() / (reference**2).sum()), results


def test_learned_rounding_beats_round_to_nearest_on_the_layer_output(tmp_path):
    weights = {"num_bits": 2, "symmetric": False, "group_size": 16}
    rtn_error, _ = layer_error(tmp_path / "rtn", RTNStage(type="rtn", weights=weights), RTNRun)
    stage = AutoRoundStage(type="autoround", weights=weights, steps=60, batch_size=4)
    learned_error, results = layer_error(tmp_path / "ar", stage, AutoRoundRun)
    assert learned_error < 0.5 * rtn_error, (learned_error, rtn_error)
    codes = next(iter(results.values())).codes
    assert codes.dtype == torch.int8 and codes.min() >= -2 and codes.max() <= 1


def test_float_formats_and_actorder_are_refused():
    for weights, message in [({"scheme": "NVFP4A16"}, "float formats"), ({"scheme": "FP8"}, "float formats"),
                             ({"scheme": "W4A16", "weights": {"actorder": "static"}}, "actorder")]:
        with pytest.raises(ValidationError, match=message):
            AutoRoundStage(type="autoround", **weights)


def test_learning_rate_follows_the_reference():
    assert AutoRoundStage(type="autoround", scheme="W4A16").learning_rate() == 1 / 200
    assert AutoRoundStage(type="autoround", scheme="W2A16", steps=1000).learning_rate() == 2 / 1000
    assert AutoRoundStage(type="autoround", scheme="W4A16", lr=0.01).learning_rate() == 0.01


def test_quantize_with_autoround_writes_an_artifact_transformers_loads(tmp_path, calib_file):
    model = build_tiny_model(tmp_path / "model", seed=4)
    stage = "  - type: autoround\n    scheme: W4A16\n    weights: {group_size: 16}\n    steps: 10\n    batch_size: 2\n"
    artifact = run_quantize(load_recipe(write_recipe(tmp_path / "r.yaml", model, tmp_path / "out", stage, calib_file)))
    scales = load_file(artifact / "model-00001-of-00003.safetensors")["model.layers.0.self_attn.q_proj.weight_scale"]
    assert (scales < 0).any()  # full range: negative scales, which every reader multiplies by as they are
    served = AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32).eval()
    ours = load_model(str(artifact)).model
    ids = torch.randint(0, served.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(served(ids).logits, ours(ids).logits)
        expected = served.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=16, do_sample=False,
                                   eos_token_id=None)
    llm = LLM(str(artifact), EngineConfig(dtype=torch.float32))
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert run_staggered(llm, [ids[0].tolist()], greedy) == [expected[0, 12:].tolist()]
