"""compressed-tensors pack-quantized bit layout: signed b-bit codes shifted by 2^(b-1), packed little-endian
and sequentially along the last dim into int32 (element i of each run of 32 // b at bits [i*b, i*b + b))."""
import torch

SUPPORTED_BITS = (2, 4, 8)


def pack_int32(codes: torch.Tensor, num_bits: int) -> torch.Tensor:
    """[rows, cols] int8 codes -> [rows, ceil(cols * num_bits / 32)] int32."""
    if num_bits not in SUPPORTED_BITS:
        raise ValueError(f"pack_int32 supports {SUPPORTED_BITS} bits, not {num_bits}")
    per_word = 32 // num_bits
    rows, cols = codes.shape
    unsigned = (codes.to(torch.int64) + (1 << (num_bits - 1))) & ((1 << num_bits) - 1)
    padded = torch.nn.functional.pad(unsigned, (0, (-cols) % per_word))
    shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
    words = (padded.reshape(rows, -1, per_word) << shifts).sum(dim=-1)
    return _as_int32(words)


def unpack_int32(packed: torch.Tensor, num_bits: int, num_cols: int) -> torch.Tensor:
    """Inverse of pack_int32: int32 words -> [rows, num_cols] int8 codes."""
    per_word = 32 // num_bits
    shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
    unsigned = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    codes = unsigned.reshape(packed.shape[0], -1)[:, :num_cols] - (1 << (num_bits - 1))
    return codes.to(torch.int8)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
