"""The VNNI int8 GEMM on packed weights (layers/cpu_int8_gemm.py) against torch._int_mm: the same exact int32 sums
for every row count, ragged widths and depths, the extreme codes, and past MAX_PACKED_ROWS (where _int_mm serves);
with the scales and bias applied in the kernel, scale_sums' bits."""
import pytest
import torch

from llmc.quant.qtypes import QuantArgs, quantize_weight
from llmc.quant.quantized_mm import int8_mm, scale_sums
from llmc.runtime.layers import cpu_int8_gemm


@pytest.fixture(autouse=True)
def needs_vnni():
    if not cpu_int8_gemm.available():
        pytest.skip("no AVX-512 VNNI (or no C++ toolchain) on this machine: torch._int_mm serves")


def codes(rows: int, columns: int, seed: int) -> torch.Tensor:
    return torch.randint(-128, 128, (rows, columns), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("out_features, in_features", [(96, 200), (17, 7), (192, 576), (40, 130), (3, 5)])
def test_packed_sums_equal_int_mm_for_every_row_count(out_features, in_features):
    weight = codes(out_features, in_features, 0)
    matmul = cpu_int8_gemm.PackedInt8Matmul(weight, scale_sums)
    for rows in (1, 2, 5, 8, 9, 16, 23, 64, 65, 130):
        x = codes(rows, in_features, rows)
        assert torch.equal(matmul(x, weight), x.int() @ weight.int().t()), rows


def test_extreme_codes_sum_exactly():
    weight = torch.full((48, 1536), -128, dtype=torch.int8)
    weight[::2] = 127
    x = torch.full((3, 1536), -128, dtype=torch.int8)
    x[1] = 127
    matmul = cpu_int8_gemm.PackedInt8Matmul(weight, scale_sums)
    assert torch.equal(matmul(x, weight), int8_mm(x, weight))


def test_rows_get_their_own_sums_whatever_rows_share_the_call():
    weight, x = codes(576, 576, 1), codes(16, 576, 2)
    matmul = cpu_int8_gemm.PackedInt8Matmul(weight, scale_sums)
    together = matmul(x, weight)
    assert all(torch.equal(together[row], matmul(x[row : row + 1], weight)[0]) for row in range(len(x)))


def test_mismatched_codes_are_refused():
    matmul = cpu_int8_gemm.PackedInt8Matmul(codes(32, 64, 0), scale_sums)
    with pytest.raises(RuntimeError, match="do not match the packed weight"):
        matmul(codes(2, 72, 1), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_scaled_kernel_gives_scale_sums_bits(dtype, strategy):
    generator = torch.Generator().manual_seed(4)
    weight = quantize_weight(torch.randn(200, 72, generator=generator), QuantArgs(num_bits=8, strategy=strategy))
    bias = torch.randn(200, generator=generator).to(dtype)
    matmul = cpu_int8_gemm.PackedInt8Matmul(weight.codes, scale_sums)
    for rows in (1, 7, 64, 65):
        x = codes(rows, 72, rows)
        per_row = torch.rand(rows, generator=generator) * 1e-2
        for act_scale, with_bias in ((per_row, bias), (per_row[:1], None)):
            expected = scale_sums(int8_mm(x, weight.codes), act_scale, weight.scale, with_bias, dtype)
            got = matmul.scaled(x, act_scale, weight, with_bias, dtype)
            assert got.dtype == dtype and torch.equal(got, expected), (rows, with_bias is None)
