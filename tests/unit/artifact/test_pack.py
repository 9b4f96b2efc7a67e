import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from llmc.artifact.pack import pack_int32, unpack_int32


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


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("cols", [64, 576, 40])
def test_matches_compressed_tensors_packing(num_bits, cols):
    generator = torch.Generator().manual_seed(cols + num_bits)
    low, high = -(1 << (num_bits - 1)), 1 << (num_bits - 1)
    codes = torch.randint(low, high, (24, cols), generator=generator, dtype=torch.int8)
    ours = pack_int32(codes, num_bits)
    assert torch.equal(ours, pack_to_int32(codes, num_bits))
    assert torch.equal(pack_int32(codes.t(), num_bits).t(), pack_to_int32(codes, num_bits, packed_dim=0))
    assert torch.equal(unpack_int32(ours, num_bits, cols), codes)


def test_rejects_unsupported_width():
    with pytest.raises(ValueError, match="bits, not 3"):
        pack_int32(torch.zeros(1, 32, dtype=torch.int8), 3)
