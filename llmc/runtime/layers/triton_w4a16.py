"""W4A16 GEMM / GEMV as a Triton kernel: 4-bit weights (int4 codes, or float4 E2M1 ones: NVFP4, MXFP4) repacked
once at load into [in / 8, out] int32 words (eight consecutive input columns of one output per word, so that a tile's
loads run along the output dim), dequantized in registers with their group scale (and zero point), multiplied in the
activations' dtype with float32 accumulation.
Small batches split the input dim across programs (atomic float32 adds) so that decode keeps every SM busy.
Imported only where it runs: on GPU, or on CPU under TRITON_INTERPRET=1 in the tests."""
import math

import torch
import triton
import triton.language as tl

PACK = tl.constexpr(8)  # int4 codes per int32 word
MIN_BLOCK_K = 16  # tl.dot's smallest inner dimension


@triton.jit
def _w4a16_kernel(
    x, packed, scales, zeros, out, M, N, K, group_size, stride_x, stride_out,
    HAS_ZEROS: tl.constexpr, FLOAT4: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """BLOCK_K divides group_size and K: one K tile reads each packed word once and one row of scales."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    shifts = tl.arange(0, PACK) * 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(tl.program_id(2) * BLOCK_K, K, BLOCK_K * SPLIT_K):
        ks = start + tl.arange(0, BLOCK_K)
        a = tl.load(x + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None], other=0.0)
        word_rows = start // PACK + tl.arange(0, BLOCK_K // PACK)
        words = tl.load(packed + word_rows[:, None] * N + cols[None, :], mask=col_mask[None, :], other=0)
        nibbles = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]: k = 8 * word + nibble
        nibbles = tl.reshape(nibbles, (BLOCK_K, BLOCK_N))
        if FLOAT4:  # sign bit, two exponent bits, one mantissa bit: 0, 0.5 (subnormal), then 2^(e - 1) * (1 + m / 2)
            exponent, mantissa = (nibbles >> 1) & 3, (nibbles & 1).to(tl.float32)
            magnitude = tl.where(exponent == 0, 0.5 * mantissa, tl.exp2((exponent - 1).to(tl.float32)) * (1.0 + 0.5 * mantissa))
            codes = tl.where((nibbles & 8) != 0, -magnitude, magnitude)
        else:
            codes = nibbles.to(tl.float32) - 8.0
        group_offsets = (start // group_size) * N + cols
        if HAS_ZEROS:
            codes -= tl.load(zeros + group_offsets, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        w = codes * tl.load(scales + group_offsets, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc += tl.dot(a, w.to(a.dtype))
    offsets = rows[:, None] * stride_out + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out + offsets, acc.to(out.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out + offsets, acc, mask=mask)


def repack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """4-bit values [out, in] (in a multiple of 8) -> int32 words [in / 8, out]; nibble j of word [r, n] holds
    nibbles[n, 8r + j]."""
    unsigned = nibbles.to(torch.int32).t().reshape(-1, PACK.value, nibbles.shape[0])  # [in / 8, 8, out]
    shifts = (torch.arange(PACK.value, dtype=torch.int32, device=nibbles.device) * 4).reshape(1, PACK.value, 1)
    return (unsigned << shifts).sum(dim=1, dtype=torch.int32).contiguous()  # nibbles are disjoint: sum == or


def _split_k(num_tiles: int, num_k_blocks: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(num_k_blocks, target // num_tiles))


def w4a16_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
    split_k: int | None = None, float4: bool = False,
) -> torch.Tensor:
    """x [M, K] (float16 / bfloat16 / float32) times 4-bit weights: packed [K / 8, N] (int4 codes + 8, or E2M1 codes
    with float4), scales and zeros [K / group, N]."""
    x = x.contiguous()
    (M, K), N = x.shape, packed.shape[1]
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_n, block_k = 64, math.gcd(64, group_size)
    if block_k < MIN_BLOCK_K or K % group_size:
        raise ValueError(f"the W4A16 kernel needs groups of a multiple of {MIN_BLOCK_K} that divide the {K} inputs")
    grid_mn = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    split_k = split_k or _split_k(grid_mn[0] * grid_mn[1], triton.cdiv(K, block_k), x.device)
    out = torch.zeros(M, N, dtype=torch.float32, device=x.device) if split_k > 1 else torch.empty(M, N, dtype=x.dtype, device=x.device)
    _w4a16_kernel[(*grid_mn, split_k)](
        x, packed, scales, zeros if zeros is not None else scales, out, M, N, K, group_size, x.stride(0), out.stride(0),
        HAS_ZEROS=zeros is not None, FLOAT4=float4, SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out.to(x.dtype)
