import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llmc.calib.driver import LayerRunner, build_skeleton, decoder_layers, embed, materialize
from llmc.models.checkpoint import CheckpointReader
from llmc.models.families import family_for


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
