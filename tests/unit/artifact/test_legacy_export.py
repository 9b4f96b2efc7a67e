import json
from dataclasses import replace

import pytest
import torch
from helpers import CORPUS, write_recipe
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from llmc.artifact.awq_format import awq_tensors, read_awq_weight
from llmc.artifact.gptq_format import gptq_tensors, read_gptq_weight
from llmc.artifact.reader import dense_state_dict
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.core.errors import LlmcError
from llmc.evals.loading import load_model
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.quant.qtypes import QuantArgs, QuantizedWeight
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.layers.linear import Int4CpuLinear
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

G4 = QuantArgs(num_bits=4, symmetric=False, strategy="group", group_size=4)


def word(value: int) -> int:
    """An unsigned 32-bit literal as the int32 that stores it."""
    return value - (1 << 32) if value >= 1 << 31 else value


def hand_made(symmetric: bool) -> QuantizedWeight:
    """8 outputs x 8 inputs, groups of 4: unsigned code (o + i) % 16, unsigned zero o + g (asym) or 8 (sym)."""
    out, columns = torch.arange(8).unsqueeze(1), torch.arange(8).unsqueeze(0)
    codes = ((out + columns) % 16 - 8).to(torch.int8)
    zero_point = torch.zeros(8, 2, dtype=torch.int8) if symmetric else (out + torch.arange(2) - 8).to(torch.int8)
    scale = (torch.arange(16, dtype=torch.float32).reshape(8, 2) + 1) / 64
    return QuantizedWeight(codes, scale, zero_point, replace(G4, symmetric=symmetric))


def round_trip(tmp_path, tensors, read):
    save_file(tensors, str(tmp_path / "w.safetensors"))
    return read(CheckpointReader(tmp_path), "m")


def test_gptq_layout_bits(tmp_path):
    weight = hand_made(symmetric=False)
    tensors = gptq_tensors("m", weight, "gptq_v2")
    qweight = tensors["m.qweight"]
    assert qweight.shape == (1, 8) and qweight.dtype == torch.int32  # [in / 8, out], packed along the input
    assert qweight[0, 0] == 0x76543210 and qweight[0, 1] == word(0x87654321) and qweight[0, 7] == word(0xEDCBA987)
    assert tensors["m.qzeros"].tolist() == [[0x76543210], [word(0x87654321)]]  # [groups, out / 8], exact zeros
    assert tensors["m.scales"].shape == (2, 8) and tensors["m.scales"].dtype == torch.float16
    assert tensors["m.scales"][1, 0] == weight.scale[0, 1]
    assert tensors["m.g_idx"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    symmetric = hand_made(symmetric=True)
    assert gptq_tensors("m", symmetric, "gptq")["m.qzeros"].unique().tolist() == [0x77777777]  # v1: zero 8 kept as 7
    assert gptq_tensors("m", symmetric, "gptq_v2")["m.qzeros"].unique().tolist() == [word(0x88888888)]


@pytest.mark.parametrize("symmetric, checkpoint_format", [(False, "gptq_v2"), (True, "gptq"), (True, "gptq_v2")])
def test_gptq_round_trip(tmp_path, symmetric, checkpoint_format):
    weight = hand_made(symmetric)
    tensors = gptq_tensors("m", weight, checkpoint_format)
    back = round_trip(tmp_path, tensors, lambda r, n: read_gptq_weight(r, n, weight.args, checkpoint_format))
    assert torch.equal(back.codes, weight.codes) and torch.equal(back.zero_point, weight.zero_point)
    assert torch.equal(back.dequantize().float(), weight.dequantize())  # scales k/64 are exact in fp16


def test_awq_layout_bits(tmp_path):
    weight = hand_made(symmetric=False)
    tensors = awq_tensors("m", weight)
    qweight = tensors["m.qweight"]
    assert qweight.shape == (8, 1)  # [in, out / 8], packed along the output
    # input 0 holds unsigned codes 0..7 for outputs 0..7; nibble i holds output [0, 2, 4, 6, 1, 3, 5, 7][i]
    assert qweight[0, 0] == 0x75316420 and qweight[1, 0] == word(0x86427531)
    assert tensors["m.qzeros"].tolist() == [[0x75316420], [word(0x86427531)]]  # zeros o + g, exact, interleaved
    back = round_trip(tmp_path, tensors, lambda r, n: read_awq_weight(r, n, weight.args))
    assert torch.equal(back.codes, weight.codes) and torch.equal(back.zero_point, weight.zero_point)


def unpack_nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """Written independently of llmc.artifact.pack: 8 unsigned nibbles per int32, lowest first, along dim."""
    nibbles = torch.stack([(words.to(torch.int64) >> (4 * i)) & 0xF for i in range(8)], dim=dim + 1)
    shape = list(words.shape)
    shape[dim] *= 8
    return nibbles.reshape(shape)


GPTQ_STAGE = "  - type: gptq\n    scheme: W4A16\n    weights: {{group_size: 32, actorder: {actorder}}}\n"


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_export_with_act_order_dequantizes_as_gptq_kernels_do(tmp_path, tiny_llama, calib_file, checkpoint_format):
    recipe = load_recipe(
        write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "art", GPTQ_STAGE.format(actorder="group"), calib_file),
        ["export.format=gptq", f"export.checkpoint_format={checkpoint_format}"],
    )
    artifact = run_quantize(recipe)
    config = json.loads((artifact / "config.json").read_text())["quantization_config"]
    assert json.loads((artifact / "quantize_config.json").read_text()) == config
    assert (config["quant_method"], config["bits"], config["group_size"], config["desc_act"], config["sym"]) == ("gptq", 4, 32, True, True)
    assert config["checkpoint_format"] == checkpoint_format
    reader = CheckpointReader(artifact)
    name = "model.layers.1.mlp.down_proj"
    g_idx = reader.tensor(f"{name}.g_idx").long()
    assert sorted(torch.bincount(g_idx).tolist()) == [32] * 4 and not torch.equal(g_idx, torch.arange(128) // 32)
    q = unpack_nibbles(reader.tensor(f"{name}.qweight"), 0)  # [in, out]
    z = unpack_nibbles(reader.tensor(f"{name}.qzeros"), 1) + (1 if checkpoint_format == "gptq" else 0)
    expected = ((q - z[g_idx]).half() * reader.tensor(f"{name}.scales")[g_idx]).t().float()  # fp16, as kernels do
    dense = dense_state_dict(artifact, torch.float32)[f"{name}.weight"]
    assert torch.equal(dense, expected)
    original = AutoModelForCausalLM.from_pretrained(tiny_llama).get_submodule(name).weight
    assert (dense - original).abs().max() < 0.25 * original.abs().max()


def test_awq_export_loads_and_stays_close(tmp_path, tiny_llama, calib_file):
    stages = "  - type: awq\n  - type: rtn\n    scheme: W4A16_ASYM\n    weights: {group_size: 32}\n    ignore: ['re:.*down_proj']\n"
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "art", stages, calib_file), ["export.format=awq"])
    artifact = run_quantize(recipe)
    config = json.loads((artifact / "config.json").read_text())["quantization_config"]
    assert config == {"quant_method": "awq", "zero_point": True, "group_size": 32, "bits": 4, "version": "gemm",
                      "modules_to_not_convert": ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]}
    reader = CheckpointReader(artifact)
    assert reader.tensor("model.layers.0.self_attn.q_proj.qweight").shape == (64, 8)
    assert "model.layers.0.mlp.down_proj.weight" in reader
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = load_model(str(artifact)).model(ids).logits
        original = AutoModelForCausalLM.from_pretrained(tiny_llama)(ids).logits
    assert (ours - original).pow(2).mean() < 0.05 * original.pow(2).mean()


@pytest.mark.parametrize("export, stages", [
    ("gptq", GPTQ_STAGE.format(actorder="group")),
    ("awq", "  - type: awq\n  - type: rtn\n    scheme: W4A16_ASYM\n    weights: {group_size: 32}\n"),
])
def test_legacy_exports_serve_as_transformers_reads_them(tmp_path, tiny_llama, calib_file, export, stages):
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "art", stages, calib_file), [f"export.format={export}"])
    artifact = run_quantize(recipe)
    loaded = load_model(str(artifact))
    loaded.model.generation_config.eos_token_id = None  # as ignore_eos
    ids = loaded.tokenizer.encode(CORPUS[:40], add_special_tokens=False)
    with torch.no_grad():
        expected = loaded.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :].tolist()
    llm = LLM(str(artifact), EngineConfig(dtype=torch.float32))
    served = llm.generate([CORPUS[:40]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]["token_ids"]
    assert served == expected
    if export == "gptq":  # act-order columns: the int4 CPU kernel has no g_idx, so it must not be chosen
        bf16 = LLM(str(artifact), EngineConfig(dtype=torch.bfloat16))
        assert not any(isinstance(module, Int4CpuLinear) for module in bf16.runner.model.modules())


@pytest.mark.parametrize("override, message", [
    ("export.format=awq", "export.format awq: needs num_bits 4 with strategy group"),
    ("export.format=gptq", "checkpoint_format gptq \\(v1\\) stores zero - 1"),
])
def test_legacy_exports_refuse_what_their_layout_cannot_hold(tmp_path, tiny_llama, override, message):
    if "awq" in override:
        stage = "  - type: rtn\n    scheme: W8A16\n"
    else:
        stage = "  - type: rtn\n    scheme: W4A16_ASYM\n    weights: {group_size: 32}\n"
    with pytest.raises(LlmcError, match=message):
        load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "art", stage), [override])
