import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from pydantic import ValidationError

from llmc.artifact.compressed_tensors import to_ct_args
from llmc.quant.qtypes import QuantArgs, compute_qparams, fake_quantize, observe_minmax, quantize_weight

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
    with pytest.raises(ValidationError):
        QuantArgs(num_bits=3)
    with pytest.raises(ValidationError, match="positive group_size"):
        QuantArgs(strategy="group", group_size=0)
