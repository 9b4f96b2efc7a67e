"""Artifacts in the formats beyond int4/int8/FP8, held against compressed-tensors: each Linear's stored tensors are
what its own compressor makes of the same codes and scales, its decompressor (through transformers) gives back
llmc's weights, and llmc's engine generates what transformers does on those weights."""
import json
from dataclasses import replace

import pytest
import torch
from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.quantization import QuantizationScheme
from helpers import CORPUS, artifact_tensors, write_recipe
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

from llmc.artifact.compressed_tensors import to_ct_args
from llmc.artifact.ct_config import schemes_from_config
from llmc.artifact.reader import dense_state_dict, layout_of, scheme_of
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.evals.loading import load_model
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

# (scheme, algorithm): each new format (NVFP4 and MXFP4 hold NVFP4A16's and MXFP4A16's weights), by RTN or GPTQ
ARTIFACTS = [("NVFP4", "gptq"), ("MXFP4", "rtn"), ("MXFP8", "rtn"), ("W4A8", "rtn"), ("W4AFP8", "gptq"), ("W3A16", "gptq"),
             ("W2A16", "rtn")]
EXPECTED_FORMAT = {"NVFP4A16": "nvfp4-pack-quantized", "NVFP4": "nvfp4-pack-quantized", "MXFP4A16": "mxfp4-pack-quantized",
                   "MXFP4": "mxfp4-pack-quantized", "MXFP8": "mxfp8-quantized", "W4A8": "pack-quantized",
                   "W4AFP8": "pack-quantized", "W3A16": "pack-quantized", "W2A16": "pack-quantized"}
PROMPTS = [" ".join(CORPUS.split()[start : start + 6]) for start in (0, 13)]
NEW_TOKENS = 16


@pytest.fixture(scope="module", params=ARTIFACTS, ids=lambda case: "-".join(case))
def artifact(request, tmp_path_factory, tiny_llama, calib_file):
    scheme, algorithm = request.param
    folder = tmp_path_factory.mktemp(f"{scheme}-{algorithm}")
    group_size = "\n    weights: {group_size: 32}" if scheme.startswith("W") else ""  # the tiny model is 64 wide
    stage = f"  - type: {algorithm}\n    scheme: {scheme}{group_size}\n"
    return scheme, run_quantize(load_recipe(write_recipe(folder / "recipe.yaml", tiny_llama, folder / "out", stage, calib_file)))


def weight_of_codes(quantized) -> torch.Tensor:
    """Weights its compressor rounds to exactly these codes: the dequantized weights, but where a float4 code is -0
    (a small negative weight rounded to zero, sign kept) a quarter step below zero, which rounds to -0 again."""
    if quantized.codes.dtype != torch.float8_e4m3fn:
        return quantized.dequantize().float()
    codes = quantized.codes.float()
    negative_zero = (codes == 0) & torch.signbit(codes)
    return replace(quantized, codes=torch.where(negative_zero, -0.25, codes)).dequantize().float()


def test_each_linear_is_what_compressed_tensors_compressor_makes_of_its_codes_and_scales(artifact):
    scheme, folder = artifact
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["format"] == EXPECTED_FORMAT[scheme]
    stored = artifact_tensors(folder)
    reader = CheckpointReader(folder)
    layout, schemes = layout_of(config), schemes_from_config(config)
    names = sorted(name.removesuffix(".weight_scale") for name in stored if name.endswith(".weight_scale"))
    assert len(names) == 14
    for name in names:
        ours = layout.read(reader, name)
        _, weights, activations = scheme_of(name, schemes)
        ct_scheme = QuantizationScheme(targets=["Linear"], weights=to_ct_args(weights),
                                       input_activations=to_ct_args(activations) if activations else None)
        compressor = BaseCompressor.get_value_from_registry(config["format"])
        # its compressors take float scales, as its observers give them: float8 values (NVFP4), powers of two (MX)
        given = {"weight": weight_of_codes(ours), "weight_scale": stored[f"{name}.weight_scale"]}
        if ours.global_scale is not None:
            given |= {"weight_scale": given["weight_scale"].float(), "weight_global_scale": stored[f"{name}.weight_global_scale"]}
        if config["format"].startswith("mx"):
            given["weight_scale"] = ours.scale
        compressed = compressor.compress(given, ct_scheme)
        for key, tensor in compressed.items():
            assert torch.equal(tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor,
                               stored[f"{name}.{key}"].view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn
                               else stored[f"{name}.{key}"]), f"{name}.{key}"


def test_compressed_tensors_decompresses_the_artifact_to_llmc_weights(artifact):
    scheme, folder = artifact
    ours = dense_state_dict(folder, torch.float32)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(run_compressed=False))
    theirs = model.state_dict()
    for name, weight in ours.items():
        if scheme.startswith("NVFP4") and name.endswith("proj.weight"):  # its decompressor unpacks float4 to bfloat16
            weight = weight.to(torch.bfloat16).float()
        assert torch.equal(theirs[name].float(), weight), name


def test_engine_generates_what_transformers_does_on_the_dequantized_weights(artifact):
    _, folder = artifact
    loaded = load_model(str(folder))  # dequantized weights in float32, inputs quantized as the artifact says
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([loaded.tokenizer.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            generated = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                              do_sample=False, eos_token_id=None)
        expected.append(generated[0, ids.shape[1] :].tolist())
    llm = LLM(str(folder), EngineConfig(dtype=torch.float32, num_kv_blocks=32))
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [output["token_ids"] for output in outputs] == expected
