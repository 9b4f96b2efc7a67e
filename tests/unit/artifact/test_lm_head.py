"""A recipe's `lm_head` section: the head quantized into the artifact as compressed-tensors writes a quantized Linear
(a tied head untied, the embedding table kept), read back by compressed-tensors and transformers as llmc's
dequantization gives it, served by the runtime with transformers' greedy tokens (float32) on its int4 kernel
(bfloat16), and the recipes that cannot have one refused with the field named."""
import json

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationScheme
from helpers import CORPUS, artifact_tensors, build_tiny_model, write_recipe

from llmc.artifact.compressed_tensors import to_ct_args
from llmc.artifact.reader import layout_of
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.core.errors import LlmcError
from llmc.evals.loading import load_model
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.quant.qtypes import QuantArgs, quantize_weight
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.layers.linear import Int4CpuLinear
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

STAGES = "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n"
HEAD = "lm_head:\n  scheme: W4A16\n  weights: {group_size: 32}\n"  # the layers' format: one config group


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tied"), hidden=64, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def artifact(tied_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-head")
    return run_quantize(load_recipe(write_recipe(folder / "recipe.yaml", tied_model, folder / "artifact", STAGES + HEAD)))


def test_the_head_is_written_as_a_quantized_linear_of_its_own(artifact, tied_model):
    config = json.loads((artifact / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and "lm_head" not in config["quantization_config"]["ignore"]
    # named beside "Linear": vLLM builds a quantized ParallelLMHead only for a target naming it
    assert config["quantization_config"]["config_groups"]["group_0"]["targets"] == ["Linear", "lm_head"]
    tensors = artifact_tensors(artifact)
    assert {"lm_head.weight_packed", "lm_head.weight_scale"} <= set(tensors) and "lm_head.weight" not in tensors
    source = CheckpointReader(tied_model).tensor("model.embed_tokens.weight")
    assert torch.equal(tensors["model.embed_tokens.weight"], source)  # the table is kept as it was
    expected = quantize_weight(source.float(), QuantArgs(num_bits=4, group_size=32), tensors["lm_head.weight_scale"].dtype)
    read = layout_of(config["quantization_config"]).read(CheckpointReader(artifact), "lm_head")
    assert torch.equal(read.codes, expected.codes) and torch.equal(read.scale, expected.scale)
    # compressed-tensors' own decompressor, and transformers' loading, give llmc's dequantized head
    scheme = QuantizationScheme(targets=["Linear"], weights=to_ct_args(expected.args))
    decompressed = PackedQuantizationCompressor.decompress(CheckpointReader(artifact).state_dict("lm_head"), scheme)["weight"]
    assert torch.equal(decompressed.float(), expected.dequantize().float())
    loaded = load_model(str(artifact))
    assert torch.equal(loaded.model.lm_head.weight.float(), expected.dequantize().float())


def test_the_runtime_serves_it_with_transformers_greedy_tokens(artifact):
    loaded = load_model(str(artifact))
    prompt = " ".join(CORPUS.split()[:12])
    ids = torch.tensor([loaded.tokenizer.encode(prompt, add_special_tokens=False)])
    loaded.model.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    exact = LLM(str(artifact), EngineConfig(dtype=torch.float32))
    assert exact.generate([prompt], greedy)[0]["token_ids"] == expected.tolist()
    bfloat16 = LLM(str(artifact), EngineConfig())
    assert isinstance(bfloat16.runner.model.lm_head, Int4CpuLinear)


@pytest.mark.parametrize(("section", "message"), [
    ("lm_head:\n  scheme: W8A8\n", "weight-only schemes"),
    ("lm_head:\n  weights: {num_bits: 4, actorder: group}\n", "rounded to nearest"),
    ("lm_head:\n  scheme: W4A16\nexport: {format: gptq}\n", "compressed-tensors only"),
])
def test_recipes_that_cannot_quantize_the_head_are_refused(tied_model, tmp_path, section, message):
    recipe = write_recipe(tmp_path / "recipe.yaml", tied_model, tmp_path / "out", STAGES + section)
    with pytest.raises(LlmcError, match=message) as error:
        load_recipe(recipe)
    assert "lm_head" in str(error.value)
