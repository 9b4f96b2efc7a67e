"""The formats beyond int4/int8/FP8 (NVFP4, MXFP4, MXFP8, W4A8, W4AFP8, W3A16, W2A16): presets, rounding and
scales held against compressed-tensors' own reference arithmetic."""
import pytest
import torch
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams, compute_dynamic_scales_and_zp, generate_gparam

from llmc.artifact.compressed_tensors import to_ct_args
from llmc.quant.gptq import gptq_quantize
from llmc.quant.qtypes import QuantArgs, fake_quantize_activation, global_scale_of, quantize_weight, round_to_e2m1
from llmc.quant.rtn import RTNStage
from llmc.quant.schemes import resolve_activation_args, resolve_weight_args

NEW_PRESETS = ["NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8", "W4A8", "W4AFP8", "W3A16", "W2A16"]
WEIGHT_PRESETS = ["NVFP4A16", "MXFP4A16", "MXFP8A16", "W3A16", "W2A16", "W4A16"]
ACTIVATION_PRESETS = ["NVFP4", "MXFP4", "MXFP8", "W4A8", "W4AFP8"]


def preset(name: str) -> tuple[QuantArgs, QuantArgs | None]:
    activations = resolve_activation_args(name, None)
    return QuantArgs(**resolve_weight_args(name, {})), QuantArgs(**activations) if activations else None


def outlier_weight(rows: int = 48, cols: int = 256) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows + cols)
    weight = torch.randn(rows, cols, generator=generator) * torch.rand(rows, 1, generator=generator) * 3
    weight[3, 17] = 40.0  # one outlier: its group's scale and (NVFP4) the global scale follow it
    weight[5, :32] = 0.0  # an all-zero group: the smallest scale, no division by zero
    return weight


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_presets_are_compressed_tensors_presets(name):
    weights, activations = preset(name)
    reference = preset_name_to_scheme(name, ["Linear"])
    ignore = {"observer"}  # llmc writes the observer it used; the presets leave it to the modifier
    ours = {key: value for key, value in to_ct_args(weights).model_dump().items() if key not in ignore}
    assert ours == {key: value for key, value in reference.weights.model_dump().items() if key not in ignore}
    if activations is None:
        assert reference.input_activations is None
    else:
        ours = {key: value for key, value in to_ct_args(activations).model_dump().items() if key not in ignore}
        assert ours == {key: value for key, value in reference.input_activations.model_dump().items() if key not in ignore}


def test_e2m1_rounding_ties_to_even_mantissa_and_keeps_the_sign():
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 2.6, 3.5, 5.0, 5.1, -0.1, 7.0])
    expected = torch.tensor([0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 3.0, 4.0, 4.0, 6.0, -0.0, 6.0])
    rounded = round_to_e2m1(x)
    assert torch.equal(rounded, expected) and torch.signbit(rounded[-2])


@pytest.mark.parametrize("name", WEIGHT_PRESETS)
def test_weight_codes_and_scales_equal_compressed_tensors(name):
    weight = outlier_weight()
    args, _ = preset(name)
    ours = quantize_weight(weight, args, torch.float32)
    reference_args = preset_name_to_scheme(name, ["Linear"]).weights
    groups = weight.reshape(weight.shape[0], -1, args.group_size)
    global_scale = generate_gparam(weight.amin(), weight.amax()) if args.strategy == "tensor_group" else None
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), reference_args, global_scale=global_scale)
    codes = quantize(weight, scale, zero_point, reference_args, global_scale=global_scale)
    assert torch.equal(ours.codes.float(), codes.float())
    stored = ours.scale * ours.global_scale if ours.global_scale is not None else ours.scale
    assert torch.equal(stored.float(), scale.float())
    assert torch.equal(ours.dequantize(), dequantize(codes, scale, zero_point, reference_args, global_scale=global_scale))


@pytest.mark.parametrize("name", ACTIVATION_PRESETS)
def test_activation_quantization_equals_compressed_tensors(name):
    _, args = preset(name)
    x = outlier_weight(9, 128).unsqueeze(0) / 4  # [batch, tokens, features], as compressed-tensors' token strategy wants
    reference_args = preset_name_to_scheme(name, ["Linear"]).input_activations
    global_scale = global_scale_of(x.abs().amax() * 2) if args.dynamic == "local" else None  # as if calibrated wider
    scale, zero_point = compute_dynamic_scales_and_zp(x, reference_args, torch.nn.Linear(1, 1), global_scale=global_scale)
    expected = dequantize(quantize(x, scale, zero_point, reference_args, global_scale=global_scale), scale, zero_point,
                          reference_args, global_scale=global_scale)
    assert torch.equal(fake_quantize_activation(x, args, global_scale), expected.to(x.dtype))


def test_nvfp4_global_scale_puts_the_largest_group_scale_at_float8s_maximum():
    weight = outlier_weight()
    quantized = quantize_weight(weight, preset("NVFP4A16")[0], torch.float32)
    assert torch.equal(quantized.global_scale, generate_gparam(weight.amin(), weight.amax()))
    assert (quantized.scale * quantized.global_scale).max().item() == 448.0


@pytest.mark.parametrize("name", ["NVFP4A16", "MXFP4A16", "MXFP8A16", "W3A16", "W2A16"])
def test_gptq_writes_each_format_and_beats_rounding_on_its_own_objective(name):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 128, generator=generator)
    inputs = torch.randn(512, 128, generator=generator) @ torch.randn(128, 128, generator=generator) / 8
    hessian = 2 * inputs.T @ inputs / len(inputs)
    args, _ = preset(name)
    solved = gptq_quantize(weight, hessian, args, scale_dtype=torch.float32)
    rounded = quantize_weight(weight, args, torch.float32)
    assert solved.codes.dtype == args.code_dtype
    assert torch.equal(solved.global_scale, rounded.global_scale) if args.strategy == "tensor_group" else solved.global_scale is None

    def output_error(quantized):
        return ((inputs @ (quantized.dequantize().float() - weight).T) ** 2).mean()

    assert output_error(solved) < output_error(rounded)


def test_rtn_gives_stacked_linears_one_global_scale():
    from llmc.checkpoints.families import LLAMA_LIKE

    names = ["m.layers.0.self_attn.q_proj", "m.layers.0.self_attn.k_proj", "m.layers.0.self_attn.v_proj",
             "m.layers.0.self_attn.o_proj", "m.layers.0.mlp.experts.1.gate_proj", "m.layers.0.mlp.experts.1.up_proj",
             "m.layers.0.mlp.experts.2.gate_proj"]
    assert LLAMA_LIKE.fused_groups(names) == [names[:3], [names[3]], names[4:6], [names[6]]]


@pytest.mark.parametrize(("stage", "message"), [
    ({"scheme": "W4A16", "input_activations": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                                               "dynamic": True, "scale_dtype": "uint8"}}, "4-bit inputs are float4"),
    ({"scheme": "NVFP4A16", "input_activations": {"num_bits": 8, "strategy": "token", "dynamic": True}}, "8-bit inputs take"),
    ({"weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 16, "scale_dtype": "uint8"}},
     "needs strategy group with group_size 32"),
    ({"weights": {"num_bits": 4, "type": "float", "strategy": "channel"}}, "float4 E2M1 is NVFP4"),
    ({"scheme": "NVFP4A16", "weights": {"group_size": 32}}, "float4 E2M1 is NVFP4"),
    ({"weights": {"num_bits": 3, "scale_dtype": "float8_e4m3fn"}}, "scale_dtype is for float formats"),
    ({"scheme": "NVFP4", "input_activations": {"dynamic": True}}, "set it 'local'"),
])
def test_inconsistent_formats_are_refused_by_name(stage, message):
    with pytest.raises(ValueError, match=message):
        RTNStage.model_validate({"type": "rtn", **stage})
