"""The int8 GEMV (layers/cpu_int8_gemv.py) against torch's int8 kernel and an exact matmul: the same products up to
summation order for every row count, each row's bits independent of the rows beside it, and Int8CpuLinear taking it
in bfloat16."""
import pytest
import torch

from llmc.quant.qtypes import QuantArgs, quantize_weight
from llmc.runtime.layers import cpu_int8_gemv
from llmc.runtime.layers.linear import Int8CpuLinear, build_linear
from llmc.runtime.layers.linear_weight import LinearWeight


@pytest.fixture(autouse=True)
def kernel():
    if not cpu_int8_gemv.available():
        pytest.skip("the CPU has no AVX-512 BF16 (or no C++ toolchain): torch's int8 kernel serves")


def weight(out_features=96, in_features=192, seed=0):
    dense = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    return quantize_weight(dense, QuantArgs(num_bits=8, strategy="channel"))


def test_products_match_torchs_kernel_up_to_summation_order_and_rows_are_independent():
    quantized = weight()
    scales = quantized.scale.reshape(-1).bfloat16()
    exact_weights = quantized.codes.double() * scales.double()[:, None]
    x = torch.randn(9, 192, generator=torch.Generator().manual_seed(1)).bfloat16()
    together = cpu_int8_gemv.int8_gemv(x, quantized.codes, scales.float())
    torch.testing.assert_close(together.double(), x.double() @ exact_weights.t(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(together.float(), torch.ops.aten._weight_int8pack_mm(x, quantized.codes, scales).float(),
                               atol=2e-2, rtol=1e-2)
    assert all(torch.equal(together[row], cpu_int8_gemv.int8_gemv(x[row : row + 1], quantized.codes, scales.float())[0])
               for row in range(len(x)))


def test_int8_layers_take_it_in_bfloat16():
    quantized, bias = weight(), torch.randn(96)
    linear = build_linear([LinearWeight(quantized, bias)], torch.bfloat16, "cpu")
    assert isinstance(linear, Int8CpuLinear) and linear.gemv
    x = torch.randn(7, 192).bfloat16()
    expected = cpu_int8_gemv.int8_gemv(x, quantized.codes, quantized.scale.reshape(-1).bfloat16().float()) + bias.bfloat16()
    assert torch.equal(linear(x), expected)
    assert not Int8CpuLinear(LinearWeight(weight(in_features=96)), torch.bfloat16, "cpu").gemv  # not a multiple of 64
