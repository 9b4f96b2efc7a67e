"""The CPU W8A8 and FP8 kernels (layers/cpu_quantized_mm.py) against the torch ops they replace: the same codes and
scales, the same scaled sums and W8A8 output bits, FP8 sums rounded once, and a row's result independent of the rows
beside it."""
import pytest
import torch

from llmc.quant.qtypes import QuantArgs, QuantizedWeight, quantize_activation, quantize_weight
from llmc.quant.quantized_mm import codes_mm, int8_mm, quantized_linear, scale_sums
from llmc.runtime.layers import cpu_int8_gemm, cpu_quantized_mm
from llmc.runtime.layers.linear import build_linear
from llmc.runtime.layers.linear_weight import LinearWeight
from llmc.runtime.layers.onednn_packed import onednn_runs_bfloat16
from llmc.runtime.layers.quantized_input_linear import QuantizedInputLinear

PER_TOKEN = QuantArgs(num_bits=8, strategy="token", dynamic=True)
STATIC = QuantArgs(num_bits=8, strategy="tensor", dynamic=False)
FP8_PER_TOKEN = QuantArgs(num_bits=8, type="float", strategy="token", dynamic=True)


def needs_kernel():
    if cpu_quantized_mm.compiled_kernel() is None:
        pytest.skip("no C++ toolchain for the activation kernel")


def inputs(dtype: torch.dtype, rows: int = 7, features: int = 200) -> torch.Tensor:
    x = torch.randn(rows, features, generator=torch.Generator().manual_seed(3)) * 4
    x[1] = 0  # a zero row takes the epsilon scale
    x[2, :5] = torch.tensor([127.5, -127.5, 0.5, 1.5, 2.5]) * 0.01  # halves: rounded to even
    x[3] *= 1e-30
    return x.to(dtype)


@pytest.mark.parametrize("args", [PER_TOKEN, FP8_PER_TOKEN], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_per_token_kernel_gives_quantize_activations_codes_and_scales(dtype, args):
    needs_kernel()
    x = inputs(dtype)
    codes, scale = cpu_quantized_mm.quantize_activation_cpu(x, args)
    expected_codes, expected_scale = quantize_activation(x, args)
    assert codes.dtype == args.code_dtype and torch.equal(codes.view(torch.int8), expected_codes.view(torch.int8))
    if args.type == "float":
        as_bfloat16, _ = cpu_quantized_mm.quantize_fp8_as_bfloat16(x, args)
        assert as_bfloat16.dtype == torch.bfloat16 and torch.equal(as_bfloat16, expected_codes.bfloat16())
    assert torch.equal(scale.reshape(-1), expected_scale.reshape(-1))


def test_static_kernel_uses_the_calibrated_scale_and_clamps():
    needs_kernel()
    x, static_scale = inputs(torch.bfloat16), torch.tensor(0.02)
    codes, scale = cpu_quantized_mm.quantize_activation_cpu(x, STATIC, static_scale)
    expected_codes, expected_scale = quantize_activation(x, STATIC, static_scale)
    assert torch.equal(codes, expected_codes) and torch.equal(scale, expected_scale)
    assert codes.min() == -128 and codes.max() == 127


def test_kernel_takes_only_symmetric_8_bit_per_token_or_static_tensor():
    assert cpu_quantized_mm.kernel_quantizes(PER_TOKEN) and cpu_quantized_mm.kernel_quantizes(STATIC)
    assert not cpu_quantized_mm.kernel_quantizes(QuantArgs(num_bits=8, strategy="token", dynamic=True, symmetric=False))
    assert not cpu_quantized_mm.kernel_quantizes(QuantArgs(num_bits=8, strategy="tensor", dynamic=True))
    assert cpu_quantized_mm.kernel_quantizes(FP8_PER_TOKEN)
    assert not cpu_quantized_mm.kernel_quantizes(QuantArgs(num_bits=8, type="float", strategy="group", group_size=128, dynamic=True))


@pytest.mark.parametrize("sums_dtype", [torch.int32, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_kernel_gives_scale_sums_bits(sums_dtype, dtype):
    needs_kernel()
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (9, 300), dtype=torch.int8, generator=generator)
    weight = torch.randint(-127, 128, (70, 300), dtype=torch.int8, generator=generator)
    sums = int8_mm(codes, weight).to(sums_dtype)
    act_scale, weight_scale = torch.rand(9, generator=generator) / 100, torch.rand(70, generator=generator) / 100
    bias = torch.randn(70, generator=generator).to(dtype)
    for act, per_channel, b in [(act_scale, weight_scale, bias), (act_scale[:1], weight_scale[:1], None)]:
        out = cpu_quantized_mm.scale_sums_cpu(sums, act, per_channel, b, dtype)
        assert out.dtype == dtype and torch.equal(out, scale_sums(sums, act, per_channel, b, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_layer_gives_the_torch_ops_bits_and_rows_their_own(dtype):
    needs_kernel()
    weight = quantize_weight(torch.randn(96, 200, generator=torch.Generator().manual_seed(1)), QuantArgs(num_bits=8, strategy="channel"))
    weight.input_activations = PER_TOKEN
    bias = torch.randn(96)
    layer = build_linear([LinearWeight(weight, bias)], dtype, "cpu")
    expected_matmul = cpu_int8_gemm.PackedInt8Matmul if cpu_int8_gemm.available() else type(codes_mm)
    assert isinstance(layer, QuantizedInputLinear) and isinstance(layer.kernels.codes_matmul, expected_matmul)
    assert layer.kernels.quantize_input is cpu_quantized_mm.quantize_activation_cpu
    assert layer.kernels.scale_sums is cpu_quantized_mm.scale_sums_cpu
    x = inputs(dtype)
    reference = QuantizedWeight(weight.codes, weight.scale.float(), weight.zero_point, weight.args, None, PER_TOKEN)
    out = layer(x)
    assert torch.equal(out, quantized_linear(x, reference, None, bias.to(dtype)))
    assert all(torch.equal(out[row], layer(x[row : row + 1])[0]) for row in range(len(x)))


def test_fp8_sums_on_packed_bfloat16_codes_are_float32_sums_rounded_once():
    generator = torch.Generator().manual_seed(0)
    codes = (torch.randn(9, 576, generator=generator) * 40).to(torch.float8_e4m3fn)
    weight = (torch.randn(1536, 576, generator=generator) * 40).to(torch.float8_e4m3fn)
    sums = cpu_quantized_mm.PackedFp8Matmul(weight)(codes, weight)
    exact = codes.double() @ weight.double().t()
    assert sums.dtype == torch.bfloat16
    torch.testing.assert_close(sums.double(), exact, atol=0, rtol=2**-8)


def test_fp8_layer_in_bfloat16_runs_packed_codes_close_to_float32_and_rows_get_their_own_bits():
    needs_kernel()
    args = QuantArgs(num_bits=8, type="float", strategy="channel")
    weight = quantize_weight(torch.randn(96, 200, generator=torch.Generator().manual_seed(1)), args)
    weight.input_activations = FP8_PER_TOKEN
    layer = build_linear([LinearWeight(weight)], torch.bfloat16, "cpu")
    packed = onednn_runs_bfloat16()  # oneDNN's bfloat16 GEMM needs AVX-512 or AVX-NE-CONVERT
    assert isinstance(layer.kernels.codes_matmul, cpu_quantized_mm.PackedFp8Matmul) == packed
    assert (layer.codes.dtype == torch.float8_e4m3fn) == packed
    assert (layer.kernels.quantize_input is cpu_quantized_mm.quantize_fp8_as_bfloat16) == packed
    x = inputs(torch.bfloat16)
    out = layer(x)
    reference = build_linear([LinearWeight(weight)], torch.float32, "cpu")(x.float())
    torch.testing.assert_close(out.float(), reference, atol=1e-6, rtol=2**-7)
    assert all(torch.equal(out[row], layer(x[row : row + 1])[0]) for row in range(len(x)))
