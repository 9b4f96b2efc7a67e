import json

import torch
from helpers import first_layer, write_recipe
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from llmc.calib.driver import build_skeleton, decoder_layers, embed, materialize
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.checkpoints.families import family_for
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.quant.layer import LayerRunner, parameters_in


def test_layer_by_layer_matches_the_full_model(tiny_llama):
    config = AutoConfig.from_pretrained(tiny_llama)
    family = family_for(config)
    reader = CheckpointReader(tiny_llama)
    skeleton = build_skeleton(AutoConfig.from_pretrained(tiny_llama))
    input_ids = torch.randint(0, config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    runner = LayerRunner(skeleton, config, seq_len=24, batch_size=2)
    hidden = embed(reader, family, input_ids)
    layers = decoder_layers(skeleton, family)
    for index, layer in enumerate(layers):
        materialize(layer, reader, f"{family.layers}.{index}")
        hidden = runner(layer, hidden)
        layer.to("meta")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        expected = model.model(input_ids).last_hidden_state
    weight = reader.tensor("model.norm.weight")
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * weight
    torch.testing.assert_close(normed, expected, atol=1e-5, rtol=1e-4)
    assert all(p.device.type == "meta" for p in layers.parameters())


def test_bfloat16_forward_keeps_the_float32_weights(tiny_llama):
    setup = first_layer(tiny_llama, num_samples=4, seq_len=16, seed=1)
    config, skeleton, layer, hidden = setup.config, setup.skeleton, setup.layer, setup.hidden
    before = {name: (parameter.data_ptr(), parameter.detach().clone()) for name, parameter in layer.named_parameters()}
    seen = []
    handle = layer.mlp.down_proj.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
    exact = LayerRunner(skeleton, config, seq_len=16)(layer, hidden)
    fast = LayerRunner(skeleton, config, seq_len=16, compute_dtype=torch.bfloat16)(layer, hidden)
    handle.remove()
    assert seen == [torch.float32, torch.bfloat16] and fast.dtype == torch.float32
    torch.testing.assert_close(fast, exact, rtol=0.05, atol=0.05)
    for name, parameter in layer.named_parameters():  # the very same float32 storage, untouched
        assert parameter.data_ptr() == before[name][0] and torch.equal(parameter, before[name][1])
    with parameters_in(layer, torch.bfloat16):
        assert all(parameter.dtype == torch.bfloat16 for parameter in layer.parameters())


def test_bfloat16_calibration_leaves_data_free_weights_bit_identical(tmp_path, tiny_llama, calib_file):
    """RTN does not use the data: whatever precision the calibration passes ran in, the weights written are the
    same, i.e. no weight went through bfloat16."""
    stage = "  - type: rtn\n    scheme: W8A16\n"
    artifacts = {}
    for dtype in ("float32", "bfloat16"):
        path = write_recipe(tmp_path / f"{dtype}.yaml", tiny_llama, tmp_path / dtype, stage, calib_file)
        path.write_text(path.read_text().replace("  seq_len: 32\n", f"  seq_len: 32\n  dtype: {dtype}\n"))
        artifacts[dtype] = run_quantize(load_recipe(path))
    tensors = [load_file(next(artifacts[dtype].glob("*.safetensors"))) for dtype in ("float32", "bfloat16")]
    assert tensors[0].keys() == tensors[1].keys()
    assert all(torch.equal(tensors[0][name], tensors[1][name]) for name in tensors[0])
    manifest = json.loads((artifacts["bfloat16"] / "llmc.json").read_text())
    assert manifest["calibration"]["dtype"] == "bfloat16"
    errors = [layer["output_error"] for layer in manifest["layers"]]
    assert all(error is not None and 0 < error < 0.01 for error in errors)


def test_the_next_layer_gets_its_inputs_quantized_as_served():
    """The driver's last pass over a layer with quantized inputs: each Linear sees them fake-quantized as the runtime
    quantizes them (dynamic per token, or by the static scale calibrated before), and only inside the pass."""
    from torch import nn

    from llmc.calib.observers import quantizing_inputs
    from llmc.quant.qtypes import QuantArgs, fake_quantize_activation
    from llmc.quant.schemes import ACTIVATION_PRESETS

    torch.manual_seed(0)
    layer = nn.Module()
    layer.dynamic, layer.static = nn.Linear(8, 4), nn.Linear(8, 4)
    layer.static.register_buffer("input_scale", torch.tensor([0.05]))
    per_token, per_tensor = QuantArgs(**ACTIVATION_PRESETS["W8A8"]), QuantArgs(**ACTIVATION_PRESETS["FP8"])
    x = torch.randn(3, 8)
    with quantizing_inputs(layer, "model.layers.0", {"model.layers.0.dynamic": per_token, "model.layers.0.static": per_tensor}):
        dynamic, static = layer.dynamic(x), layer.static(x)
    assert torch.equal(dynamic, layer.dynamic(fake_quantize_activation(x, per_token)))
    assert torch.equal(static, layer.static(fake_quantize_activation(x, per_tensor, torch.tensor([0.05]))))
    assert not torch.equal(dynamic, layer.dynamic(x)) and not torch.equal(static, layer.static(x))
