"""Paged decode attention as a Triton kernel: one program per (sequence, KV head) walks the block table with an
online softmax for all the query heads that share that KV head, so each K/V block is read once. An FP8 cache is
read as float8 and multiplied by its per-KV-head scales. Imported only on GPU; tests run it on CPU under
TRITON_INTERPRET=1."""
import torch
import triton
import triton.language as tl

from llmc.runtime.layers.attention import PLAIN, AttentionBackend, ScoreShape, attend_rows


@triton.jit
def _paged_decode_kernel(
    query, k_cache, v_cache, block_tables, context_lens, out, scale, k_scale, v_scale,
    stride_query_seq, stride_query_head, stride_cache_block, stride_cache_token, stride_cache_head,
    stride_table_seq, stride_out_seq, stride_out_head,
    QUERIES_PER_KV: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    heads = kv_head * QUERIES_PER_KV + tl.arange(0, GROUP)  # GROUP: QUERIES_PER_KV padded to a power of two
    head_mask = tl.arange(0, GROUP) < QUERIES_PER_KV
    dims = tl.arange(0, HEAD_DIM)
    tokens = tl.arange(0, BLOCK_SIZE)
    q_offsets = seq * stride_query_seq + heads[:, None] * stride_query_head + dims[None, :]
    q = tl.load(query + q_offsets, mask=head_mask[:, None], other=0.0).to(tl.float32)  # [GROUP, HEAD_DIM]
    context_len = tl.load(context_lens + seq)
    k_multiplier = tl.load(k_scale + kv_head) if FP8_KV else 1.0
    v_multiplier = tl.load(v_scale + kv_head) if FP8_KV else 1.0
    running_max = tl.zeros([GROUP], dtype=tl.float32) - float("inf")
    running_sum = tl.zeros([GROUP], dtype=tl.float32)
    acc = tl.zeros([GROUP, HEAD_DIM], dtype=tl.float32)
    for index in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block_id = tl.load(block_tables + seq * stride_table_seq + index)
        offsets = block_id * stride_cache_block + tokens[:, None] * stride_cache_token + kv_head * stride_cache_head + dims[None, :]
        k = tl.load(k_cache + offsets).to(tl.float32) * k_multiplier  # [BLOCK_SIZE, HEAD_DIM]
        scores = tl.sum(q[:, None, :] * k[None, :, :], 2) * scale  # [GROUP, BLOCK_SIZE]
        scores = tl.where((index * BLOCK_SIZE + tokens < context_len)[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        weights = tl.exp(scores - new_max[:, None])
        correction = tl.exp(running_max - new_max)
        v = tl.load(v_cache + offsets).to(tl.float32) * v_multiplier
        acc = acc * correction[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], 1)
        running_sum = running_sum * correction + tl.sum(weights, 1)
        running_max = new_max
    out_offsets = seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :]
    tl.store(out + out_offsets, (acc / running_sum[:, None]).to(out.dtype.element_ty), mask=head_mask[:, None])


def decode_attention_triton(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    shape: ScoreShape = PLAIN,
) -> torch.Tensor:
    """Same contract as decode_attention_reference: [num_seqs, heads, head_dim] queries, one per sequence; plain scores
    only (the kernel policy keeps windowed and soft-capped models on the reference)."""
    assert shape == PLAIN, "the Triton decode kernel has no sliding window or soft cap"
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    queries_per_kv = num_heads // num_kv_heads
    out = torch.empty_like(query)
    fp8 = k_scale is not None
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        query, k_cache, v_cache, block_tables, context_lens, out, scale,
        k_scale if fp8 else context_lens, v_scale if fp8 else context_lens,  # unread placeholders without FP8
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        QUERIES_PER_KV=queries_per_kv, GROUP=triton.next_power_of_2(queries_per_kv), BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, FP8_KV=fp8,
    )
    return out


# CUDA models whose scores are plain (no window, no soft cap): decode rows on the Triton kernel, which walks the block
# tables itself; draft rows on the reference
TRITON_ATTENTION = AttentionBackend("triton", decode_attention_triton, attend_rows, prepares_decode_rows=False)
