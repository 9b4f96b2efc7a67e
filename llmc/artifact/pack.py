"""The bit layouts compressed-tensors stores quantized codes in.

pack-quantized: signed b-bit codes shifted by 2^(b-1), packed densely and little-endian along the last dim into
int32 words (element i of each row at bits [i*b, i*b + b) of the row's bit string: for 2, 4 and 8 bits, 32 // b
codes per word; 3-bit codes straddle words).
E2M1 (NVFP4, MXFP4): each float4 value as a 4-bit code (bit 3 the sign, bits 0-2 the magnitude's index), two per
uint8, the even column in the low nibble.
E8M0 (MX scales): a power of two 2^e as the uint8 e + 127."""
import torch

from llmc.quant.qtypes import E2M1_MAGNITUDES

SUPPORTED_BITS = tuple(range(1, 9))


def pack_int32(codes: torch.Tensor, num_bits: int) -> torch.Tensor:
    """[rows, cols] int8 codes -> [rows, ceil(cols * num_bits / 32)] int32."""
    if num_bits not in SUPPORTED_BITS:
        raise ValueError(f"pack_int32 supports 1 to 8 bits, not {num_bits}")
    unsigned = (codes.to(torch.int64) + (1 << (num_bits - 1))) & ((1 << num_bits) - 1)
    if 32 % num_bits == 0:  # whole codes per word
        per_word = 32 // num_bits
        padded = torch.nn.functional.pad(unsigned, (0, (-codes.shape[1]) % per_word))
        shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
        return _as_int32((padded.reshape(codes.shape[0], -1, per_word) << shifts).sum(dim=-1))
    return torch.cat([_pack_bits(chunk, num_bits) for chunk in unsigned.split(ROWS_PER_CHUNK)])


def unpack_int32(packed: torch.Tensor, num_bits: int, num_cols: int) -> torch.Tensor:
    """Inverse of pack_int32: int32 words -> [rows, num_cols] int8 codes."""
    if 32 % num_bits == 0:
        shifts = torch.arange(32 // num_bits, dtype=torch.int64) * num_bits
        unsigned = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
        unsigned = unsigned.reshape(packed.shape[0], -1)[:, :num_cols]
    else:
        unsigned = torch.cat([_unpack_bits(chunk, num_bits, num_cols) for chunk in packed.split(ROWS_PER_CHUNK)])
    return (unsigned - (1 << (num_bits - 1))).to(torch.int8)


ROWS_PER_CHUNK = 256  # codes that straddle words go through one int64 per bit: a few rows at a time


def _pack_bits(unsigned: torch.Tensor, num_bits: int) -> torch.Tensor:
    rows = unsigned.shape[0]
    bits = ((unsigned.unsqueeze(-1) >> torch.arange(num_bits, dtype=torch.int64)) & 1).reshape(rows, -1)
    bits = torch.nn.functional.pad(bits, (0, (-bits.shape[1]) % 32))
    return _as_int32((bits.reshape(rows, -1, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=-1))


def _unpack_bits(packed: torch.Tensor, num_bits: int, num_cols: int) -> torch.Tensor:
    rows = packed.shape[0]
    bits = (packed.to(torch.int64).unsqueeze(-1) >> torch.arange(32, dtype=torch.int64)) & 1
    bits = bits.reshape(rows, -1)[:, : num_cols * num_bits].reshape(rows, num_cols, num_bits)
    return (bits << torch.arange(num_bits, dtype=torch.int64)).sum(dim=-1)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def e2m1_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """float4 values (any float dtype; -0.0 keeps its sign bit) -> their 4-bit codes as uint8: the sign bit, then the
    index of the magnitude in E2M1_MAGNITUDES."""
    values = codes.float()
    magnitudes = torch.tensor(E2M1_MAGNITUDES, device=values.device)
    index = (values.abs().unsqueeze(-1) == magnitudes).to(torch.uint8).argmax(dim=-1).to(torch.uint8)
    return index | (torch.signbit(values).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] float4 values -> [rows, cols / 2] uint8, the even column in the low nibble."""
    if codes.shape[1] % 2:
        raise ValueError(f"float4 codes pack two per byte: {codes.shape[1]} columns is odd")
    nibbles = e2m1_nibbles(codes)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_e2m1: -> [rows, 2 * cols] float4 values held as float8 E4M3 (which holds each exactly)."""
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    magnitude = torch.tensor(E2M1_MAGNITUDES)[(nibbles & 0x07).long()]
    return torch.where((nibbles & 0x08).bool(), -magnitude, magnitude).to(torch.float8_e4m3fn)


def e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Powers of two -> their E8M0 codes."""
    return (torch.log2(scale.float()).round() + 127).clamp(0, 255).to(torch.uint8)


def from_e8m0(codes: torch.Tensor) -> torch.Tensor:
    return torch.exp2(codes.to(torch.float32) - 127)
