"""The nibble GEMV (layers/cpu_nibble_gemv.py) against llmc's dequantization: int4 and float4 weights read back as
code x scale, products within float32 summation order of a dense matmul for every row count and group size, each
row's bits independent of the rows beside it, the layout's round trip, and the kernel chosen where the CPU has it."""
import pytest
import torch
import torch.nn.functional as F

from llmc.quant.qtypes import QuantArgs, quantize_weight
from llmc.quant.schemes import NVFP4_ARGS
from llmc.runtime.layers import cpu_nibble_gemv
from llmc.runtime.layers.cpu_fp4_gemm import Fp4CpuLinear
from llmc.runtime.layers.cpu_nibble_gemv import NibbleMatmul, deinterleave_nibbles, interleave_nibbles
from llmc.runtime.layers.linear import Int4CpuLinear, build_linear
from llmc.runtime.layers.linear_weight import LinearWeight


@pytest.fixture
def kernel():
    if not cpu_nibble_gemv.available():
        pytest.skip("the CPU has no AVX-512 BF16 (or no C++ toolchain): torch's int4 kernel serves")


def int4(out_features=96, in_features=256, group_size=64, seed=0):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    return quantize_weight(weight, QuantArgs(num_bits=4, group_size=group_size))


def test_the_layout_round_trips_and_puts_code_j_plus_32_in_the_high_nibble():
    nibbles = torch.randint(0, 16, (5, 192), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    packed = interleave_nibbles(nibbles)
    assert packed.shape == (5, 96) and torch.equal(deinterleave_nibbles(packed), nibbles)
    assert packed[2, 32 + 6] == nibbles[2, 64 + 6] | (nibbles[2, 64 + 32 + 6] << 4)  # the second 64 codes
    assert cpu_nibble_gemv.fits(576, 64) and cpu_nibble_gemv.fits(64, 16)
    assert not any(cpu_nibble_gemv.fits(width, group) for width, group in [(576, 128), (96, 32), (64, 8)])


@pytest.mark.parametrize("group_size", [16, 32, 64, 128])
def test_int4_weights_are_code_times_scale_and_products_match_a_dense_matmul(kernel, group_size):
    weight = int4(group_size=group_size)
    scale = weight.scale.bfloat16()
    matmul = NibbleMatmul.int4(weight.codes, scale, group_size)
    assert torch.equal(matmul.int4_codes(), weight.codes)
    dense = weight.codes.float() * scale.float().repeat_interleave(group_size, dim=1)  # exact in float32
    # multiplying by the identity reads each weight back (rounded once, to the bfloat16 output)
    assert torch.equal(matmul(torch.eye(256, dtype=torch.bfloat16)), dense.t().bfloat16())
    for rows in (1, 2, 3, 4, 5, 9, 13):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        exact = x.double() @ dense.double().t()
        got = matmul(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
        torch.testing.assert_close(got.double(), exact, atol=1e-2, rtol=1e-2)  # the bfloat16 output's rounding


def test_each_row_gets_the_bits_it_gets_alone_and_strided_rows_are_read_as_they_lie(kernel):
    weight = int4(in_features=192)
    matmul = NibbleMatmul.int4(weight.codes, weight.scale.bfloat16(), 64)
    x = torch.randn(11, 192).bfloat16()
    together = matmul(x)
    assert all(torch.equal(together[row], matmul(x[row : row + 1])[0]) for row in range(len(x)))
    wide = torch.randn(3, 400).bfloat16()
    assert torch.equal(matmul(wide[:, 8:200]), matmul(wide[:, 8:200].contiguous()))


def test_int4_and_float4_layers_take_the_kernel_in_bfloat16_only(kernel):
    bfloat16 = build_linear([LinearWeight(int4())], torch.bfloat16, "cpu")
    assert isinstance(bfloat16, Int4CpuLinear) and isinstance(bfloat16.matmul, NibbleMatmul)
    float32 = Int4CpuLinear(LinearWeight(int4()), torch.float32, "cpu")
    assert not isinstance(float32.matmul, NibbleMatmul)
    x = torch.randn(3, 256).bfloat16()
    torch.testing.assert_close(bfloat16(x).float(), float32(x.float()), atol=0.1, rtol=0.02)
    nvfp4 = quantize_weight(torch.randn(64, 256), QuantArgs(**NVFP4_ARGS))
    fp4 = Fp4CpuLinear(LinearWeight(nvfp4), torch.bfloat16, "cpu")
    assert fp4.nibbles is not None
    assert torch.equal(fp4(torch.eye(256, dtype=torch.bfloat16)), nvfp4.dequantize().t().bfloat16())
    torch.testing.assert_close(fp4(x).float(), F.linear(x.float(), nvfp4.dequantize()), atol=0.1, rtol=0.02)
