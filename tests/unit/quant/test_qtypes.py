import pytest
import torch
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams

from llmc.artifact.compressed_tensors import to_ct_args
from llmc.artifact.ct_config import from_ct_args
from llmc.quant.qtypes import (
    MSE_NORM,
    QuantArgs,
    compute_qparams,
    fake_quantize,
    observe_minmax,
    quantize_weight,
)

FORMATS = [
    QuantArgs(num_bits=4, symmetric=True, strategy="group", group_size=32),
    QuantArgs(num_bits=4, symmetric=False, strategy="group", group_size=64),
    QuantArgs(num_bits=8, symmetric=True, strategy="channel"),
    QuantArgs(num_bits=8, symmetric=False, strategy="channel"),
    QuantArgs(num_bits=4, symmetric=True, strategy="tensor"),
]


def weight(out=48, cols=128, seed=0):
    return torch.randn(out, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_symmetric_int4_scale_is_absmax_over_7_5():
    w = torch.tensor([[0.3, -0.75, 0.1, 0.0]])
    q = quantize_weight(w, QuantArgs(num_bits=4, strategy="channel"))
    assert q.scale.item() == pytest.approx(0.75 / 7.5)
    assert q.codes.tolist() == [[3, -8, 1, 0]]  # -0.75 / 0.1 = -7.5 rounds to -8 (half to even)


@pytest.mark.parametrize("args", FORMATS, ids=lambda a: a.describe())
def test_error_bounded_by_half_a_step(args):
    w = weight()
    q = quantize_weight(w, args)
    assert q.codes.dtype == torch.int8
    assert int(q.codes.min()) >= args.qmin and int(q.codes.max()) <= args.qmax
    step = q.scale.repeat_interleave(args.group_size, dim=1) if args.strategy == "group" else q.scale
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("args", FORMATS, ids=lambda a: a.describe())
def test_agrees_with_compressed_tensors(args):
    w = weight(seed=3)
    ct_args = to_ct_args(args)
    ct_scale, ct_zero_point = calculate_qparams(*observe_minmax(w, args), ct_args)
    scale, zero_point = compute_qparams(*observe_minmax(w, args), args, torch.float32)
    torch.testing.assert_close(scale, ct_scale.reshape(scale.shape))
    assert torch.equal(zero_point.float(), torch.round(ct_zero_point.reshape(zero_point.shape).float()))
    ours = quantize_weight(w, args)
    theirs = ct_quantize(w, ct_scale, torch.round(ct_zero_point), ct_args, dtype=torch.int8)
    assert torch.equal(ours.codes, theirs)
    torch.testing.assert_close(ours.dequantize(), ct_dequantize(theirs, ct_scale, torch.round(ct_zero_point), ct_args))


def test_fake_quantize_is_idempotent():
    args = FORMATS[1]
    once = fake_quantize(weight(), args)
    torch.testing.assert_close(fake_quantize(once, args), once, atol=1e-6, rtol=0)


def test_scale_dtype_is_the_stored_one():
    q = quantize_weight(weight(), FORMATS[0], scale_dtype=torch.bfloat16)
    assert q.scale.dtype == torch.bfloat16
    assert q.dequantize().dtype == torch.bfloat16


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="does not divide 100"):
        quantize_weight(torch.zeros(4, 100), QuantArgs(group_size=64))


def test_bad_formats_rejected():
    with pytest.raises(ValueError, match="num_bits must be one of"):
        QuantArgs(num_bits=5)
    with pytest.raises(ValueError, match="positive group_size"):
        QuantArgs(strategy="group", group_size=0)


FP8_FORMATS = [
    QuantArgs(num_bits=8, type="float", strategy="tensor"),
    QuantArgs(num_bits=8, type="float", strategy="channel"),
    QuantArgs(num_bits=8, type="float", strategy="block", block_structure=(16, 32)),
]


@pytest.mark.parametrize("args", FP8_FORMATS, ids=lambda a: a.describe())
def test_fp8_agrees_with_compressed_tensors(args):
    w = weight(seed=4)
    ct_args = to_ct_args(args)
    ct_scale, _ = calculate_qparams(*observe_minmax(w, args), ct_args)
    ours = quantize_weight(w, args, torch.float32)
    assert ours.codes.dtype == torch.float8_e4m3fn and ours.scale.shape == ((1,) if args.strategy == "tensor" else ct_scale.shape)
    torch.testing.assert_close(ours.scale, ct_scale.reshape(ours.scale.shape))
    theirs = ct_quantize(w, ct_scale, None, ct_args, dtype=torch.float8_e4m3fn)
    assert torch.equal(ours.codes.float(), theirs.float())
    torch.testing.assert_close(ours.dequantize(), ct_dequantize(theirs, ct_scale, None, ct_args).float())


def test_fp8_blocks_pad_ragged_edges():
    w = weight(out=40, cols=72, seed=5)
    q = quantize_weight(w, QuantArgs(num_bits=8, type="float", strategy="block", block_structure=(16, 32)))
    assert q.scale.shape == (3, 3) and q.codes.shape == (40, 72)
    assert float(q.scale[2, 2]) == pytest.approx(float(w[32:, 64:].abs().max()) / 448, rel=1e-6)
    assert (q.dequantize() - w).abs().max() <= w.abs().max() / 16  # E4M3 keeps 3 mantissa bits


def test_dynamic_activation_scales_per_token_and_group():
    from llmc.quant.qtypes import quantize_activation

    x = torch.randn(2, 3, 80, generator=torch.Generator().manual_seed(6))
    codes, scale = quantize_activation(x, QuantArgs(num_bits=8, strategy="token", dynamic=True))
    torch.testing.assert_close(scale.reshape(-1), x.reshape(6, 80).abs().amax(-1) / 127.5)
    groups = QuantArgs(num_bits=8, type="float", strategy="group", group_size=32, dynamic=True)
    codes, scale = quantize_activation(x, groups)
    assert codes.shape == (6, 80) and scale.shape == (6, 3)  # the last group holds 16 features
    torch.testing.assert_close(scale[:, 2], x.reshape(6, 80)[:, 64:].abs().amax(-1) / 448)


def group_errors(weight: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """Each (row, group)'s quantization error in the norm the mse observer minimises."""
    error = (quantize_weight(weight, args).dequantize() - weight).abs().pow(MSE_NORM)
    return error.reshape(weight.shape[0], -1, args.group_size).sum(dim=-1)


def heavy_tailed_weight(out: int, cols: int, seed: int) -> torch.Tensor:
    """Student-t with 3 degrees of freedom, the heavy tails of trained LLM weights."""
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(out, cols, generator=generator)
    chi_square = torch.randn(3, out, cols, generator=generator).pow(2).sum(dim=0)
    return normal / (chi_square / 3).sqrt() * 0.05


@pytest.mark.parametrize("symmetric, gain", [(True, 0.9), (False, 0.98)])
def test_mse_observer_clips_outliers_and_is_never_worse_than_min_max(symmetric, gain):
    w = heavy_tailed_weight(8, 128, seed=5)
    minmax = QuantArgs(num_bits=4, symmetric=symmetric, group_size=64)
    mse = QuantArgs(num_bits=4, symmetric=symmetric, group_size=64, observer="mse")
    ratios = group_errors(w, mse) / group_errors(w, minmax)
    assert (ratios <= 1 + 1e-6).all()  # factor 1.0 is among those tried
    assert ratios.median() < gain
    ranges = quantize_weight(w, mse).scale / quantize_weight(w, minmax).scale
    assert (ranges <= 1 + 1e-6).all() and (ranges >= 0.81 - 1e-6).all() and (ranges < 0.99).any()


def test_mse_observer_is_written_to_and_read_from_compressed_tensors_config():
    args = QuantArgs(num_bits=4, group_size=64, actorder="static", observer="mse")
    ct_args = to_ct_args(args)
    assert ct_args.observer == "mse"
    assert from_ct_args(ct_args.model_dump()) == args
    assert from_ct_args(to_ct_args(QuantArgs()).model_dump()).observer == "minmax"


def test_mse_observer_is_refused_for_dynamic_scales():
    with pytest.raises(ValueError, match="observer 'mse'"):
        QuantArgs(num_bits=8, strategy="token", dynamic=True, observer="mse")
