"""Paged decode attention as a Triton kernel: one program per (sequence, head) walks the block table with an online
softmax. Imported only on GPU; tests run it on CPU under TRITON_INTERPRET=1."""
import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    query, k_cache, v_cache, block_tables, context_lens, out, scale,
    stride_query_seq, stride_query_head, stride_cache_block, stride_cache_token, stride_cache_head,
    stride_table_seq, stride_out_seq, stride_out_head,
    QUERIES_PER_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // QUERIES_PER_KV
    dims = tl.arange(0, HEAD_DIM)
    tokens = tl.arange(0, BLOCK_SIZE)
    q = tl.load(query + seq * stride_query_seq + head * stride_query_head + dims).to(tl.float32)
    context_len = tl.load(context_lens + seq)
    running_max = tl.zeros([], dtype=tl.float32) - float("inf")
    running_sum = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for index in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block_id = tl.load(block_tables + seq * stride_table_seq + index)
        offsets = block_id * stride_cache_block + tokens[:, None] * stride_cache_token + kv_head * stride_cache_head + dims[None, :]
        k = tl.load(k_cache + offsets).to(tl.float32)
        scores = tl.sum(k * q[None, :], 1) * scale
        scores = tl.where(index * BLOCK_SIZE + tokens < context_len, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 0))
        weights = tl.exp(scores - new_max)
        correction = tl.exp(running_max - new_max)
        v = tl.load(v_cache + offsets).to(tl.float32)
        acc = acc * correction + tl.sum(weights[:, None] * v, 0)
        running_sum = running_sum * correction + tl.sum(weights, 0)
        running_max = new_max
    tl.store(out + seq * stride_out_seq + head * stride_out_head + dims, (acc / running_sum).to(out.dtype.element_ty))


def decode_attention_triton(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Same contract as decode_attention_reference: [num_seqs, heads, head_dim] queries, one per sequence."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(query)
    _paged_decode_kernel[(num_seqs, num_heads)](
        query, k_cache, v_cache, block_tables, context_lens, out, scale,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        QUERIES_PER_KV=num_heads // num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
    )
    return out
