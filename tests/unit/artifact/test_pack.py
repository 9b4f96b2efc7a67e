import pytest
import torch
from compressed_tensors.compressors.mx_utils import compress_mx_scale, decompress_mx_scale
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from llmc.artifact.pack import e8m0, from_e8m0, pack_e2m1, pack_int32, unpack_e2m1, unpack_int32
from llmc.quant.qtypes import E2M1_MAGNITUDES


def test_int4_nibbles_are_sequential_and_offset_by_eight():
    codes = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7]], dtype=torch.int8)
    # unsigned nibbles 0,1,8,9,10,11,14,15; nibble i at bits 4i
    expected = sum(value << (4 * i) for i, value in enumerate([0, 1, 8, 9, 10, 11, 14, 15]))
    packed = pack_int32(codes, 4)
    assert packed.dtype == torch.int32 and packed.shape == (1, 1)
    assert packed.item() & 0xFFFFFFFF == expected


def test_int8_bytes_little_endian():
    codes = torch.tensor([[-128, -1, 0, 127]], dtype=torch.int8)
    assert pack_int32(codes, 8).item() & 0xFFFFFFFF == 0xFF_80_7F_00


@pytest.mark.parametrize("num_bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("cols", [64, 576, 40])
def test_matches_compressed_tensors_packing(num_bits, cols):
    generator = torch.Generator().manual_seed(cols + num_bits)
    low, high = -(1 << (num_bits - 1)), 1 << (num_bits - 1)
    codes = torch.randint(low, high, (24, cols), generator=generator, dtype=torch.int8)
    ours = pack_int32(codes, num_bits)
    assert torch.equal(ours, pack_to_int32(codes, num_bits))
    assert torch.equal(pack_int32(codes.t(), num_bits).t(), pack_to_int32(codes, num_bits, packed_dim=0))
    assert torch.equal(unpack_int32(ours, num_bits, cols), codes)


def test_three_bit_codes_straddle_words():
    codes = torch.full((1, 11), 3, dtype=torch.int8)  # unsigned 7 = 0b111: code 10 has bits 30, 31 and 32
    packed = pack_int32(codes, 3)
    assert packed.shape == (1, 2) and packed[0, 0].item() & 0xFFFFFFFF == 0xFFFFFFFF and packed[0, 1].item() == 1


def test_rejects_unsupported_width():
    with pytest.raises(ValueError, match="bits, not 9"):
        pack_int32(torch.zeros(1, 32, dtype=torch.int8), 9)


def every_e2m1_value(rows: int, cols: int) -> torch.Tensor:
    values = torch.tensor([*E2M1_MAGNITUDES, *(-v for v in E2M1_MAGNITUDES)])  # -0.0 included: its own code, 8
    return values[torch.randint(0, 16, (rows, cols), generator=torch.Generator().manual_seed(cols))]


@pytest.mark.parametrize("cols", [16, 64])
def test_e2m1_packing_matches_compressed_tensors(cols):
    values = every_e2m1_value(12, cols)
    packed = pack_e2m1(values)
    assert torch.equal(packed, pack_fp4_to_uint8(values))
    unpacked = unpack_e2m1(packed)
    assert unpacked.dtype == torch.float8_e4m3fn
    assert torch.equal(unpacked.float(), unpack_fp4_from_uint8(packed, 12, cols, torch.float32))
    assert torch.equal(torch.signbit(unpacked.float()), torch.signbit(values))


def test_e2m1_low_nibble_is_the_even_column():
    assert pack_e2m1(torch.tensor([[0.5, -6.0]])).item() == 0x1 | (0xF << 4)


def test_e8m0_scales_match_compressed_tensors():
    scales = torch.exp2(torch.arange(-127, 128, dtype=torch.float32))
    assert torch.equal(e8m0(scales), compress_mx_scale(scales, torch.uint8))
    assert torch.equal(from_e8m0(e8m0(scales)), scales)
    assert torch.equal(from_e8m0(e8m0(scales)).to(torch.bfloat16), decompress_mx_scale(e8m0(scales)))
