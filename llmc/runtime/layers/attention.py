"""Paged attention: K/V live in fixed-size blocks and every sequence reads them through its block table. With an
FP8 KV cache (an artifact's kv_cache_scheme), K and V are stored as float8 E4M3 divided by their calibrated
per-KV-head scale and multiplied back when read. Decode rows are attended by the AttentionBackend the model is built
with (the torch reference here, cpu_attention.py's C++ kernel, triton_attention.py's Triton kernel); prefill chunks
by SDPA."""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmc.core.integers import cdiv
from llmc.quant.kvcache import softcapped_attention, visible_keys
from llmc.quant.qtypes import QuantArgs, dequantize_columns, fake_quantize_activation, quantize_columns

FP8_KV = QuantArgs(num_bits=8, type="float", strategy="channel")


@dataclass(frozen=True, slots=True)
class ScoreShape:
    """What a layer does to its attention scores beyond scale and causality."""

    window: int | None = None  # each query sees its last `window` keys, itself included (sliding-window attention)
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)

    def capped(self, scores: torch.Tensor) -> torch.Tensor:
        return scores if self.softcap is None else torch.tanh(scores / self.softcap) * self.softcap


PLAIN = ScoreShape()


@dataclass(slots=True)
class DecodeRows:
    """Decode rows of equal padded length, attended in one matmul: each row over its own key positions padded to
    whole blocks. A row's result does not depend on the rows beside it, so a draft row computes bit for bit what
    decoding its token would, and a tree node sees only its ancestors among the drafts."""

    rows: torch.Tensor  # [r] index among the step's decode rows
    # [r, padded_len] cache slot of each key position, past `lengths` any slot (masked); or, rows that read whole blocks
    # in order (plain decoding), [r, padded_len / block_size] their blocks: gathered a block at a time
    slots: torch.Tensor
    lengths: torch.Tensor  # [r] key positions each row attends to
    whole_blocks: bool = False


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot (block_id * block_size + offset) of every new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks], padded with block 0
    context_lens: torch.Tensor  # [num_seqs] tokens in the cache once this step's are written
    seq_lens: list[int]  # context_lens as Python ints
    query_lens: list[int]  # new tokens per sequence
    num_decodes: int  # the first num_decodes sequences have exactly one new token
    # the decode rows by padded length, computed once a step; None: each layer's decode_attention works them out
    decode_rows: list[DecodeRows] | None = None


def store_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, states: torch.Tensor, kv_scale: torch.Tensor | None) -> None:
    """Write [tokens, kv_heads, head_dim] into their cache slots, quantized when the cache is FP8."""
    flat = cache.view(-1, *cache.shape[2:])
    if kv_scale is None:
        flat.index_copy_(0, slot_mapping, states)
        return
    codes = quantize_columns(states, kv_scale[:, None], torch.zeros((), dtype=torch.int8, device=states.device), FP8_KV)
    flat.view(torch.uint8).index_copy_(0, slot_mapping, codes.view(torch.uint8))  # byte copies: no float8 kernel needed


def read_kv(states: torch.Tensor, kv_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """[..., kv_heads, head_dim] cache entries in `dtype`."""
    if kv_scale is None:
        return states.to(dtype)
    return dequantize_columns(states, kv_scale[:, None].to(dtype), torch.zeros((), dtype=torch.int8, device=states.device))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, head_dim] cache -> [context_len, kv_heads, head_dim] for one sequence."""
    return cache[block_table].flatten(0, 1)[:context_len]


def decode_attention_reference(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    shape: ScoreShape = PLAIN,
) -> torch.Tensor:
    """One query token per sequence: [num_seqs, heads, head_dim] -> same shape. Plain matmuls in float32: for a
    single query, torch's CPU flash-attention kernel is twice as slow. Sequences are attended together only with
    those of the same padded length (padded_length): padded to another length, the matmuls would sum in another order,
    and in bfloat16 that changes greedy choices with the batch. k_scale / v_scale: [kv_heads], FP8 caches."""
    buckets = decode_buckets(block_tables, context_lens, k_cache.shape[1])
    return attend_rows(query, k_cache, v_cache, buckets, scale, k_scale, v_scale, shape)


def padded_length(length: int, block_size: int) -> int:
    """The key positions a decode row of `length` keys attends over: whole blocks, as many as the next power of two.
    It depends on the row's own length only, so the row sums in the same order whatever rows share its matmul; powers
    of two keep the distinct lengths of a step, and so the attention calls of every layer, few."""
    return block_size * (1 << (cdiv(length, block_size) - 1).bit_length())


def decode_buckets(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> list[DecodeRows]:
    """One query per sequence, bucketed by its padded length; the same for every layer of a step."""
    padded_blocks = torch.tensor([padded_length(length, block_size) // block_size for length in context_lens.tolist()],
                                 device=block_tables.device)
    block_tables = F.pad(block_tables, (0, max(0, int(padded_blocks.max()) - block_tables.shape[1])))  # block 0, masked
    buckets = []
    for count in padded_blocks.unique().tolist():
        rows = (padded_blocks == count).nonzero().flatten()
        buckets.append(DecodeRows(rows, block_tables[rows, :count], context_lens[rows], whole_blocks=True))
    return buckets


def attend_rows(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, buckets: list[DecodeRows], scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, shape: ScoreShape = PLAIN,
) -> torch.Tensor:
    """Decode rows [rows, heads, head_dim], each bucket in one matmul over its rows' own key positions."""
    out = torch.empty_like(query)
    for bucket in buckets:
        keys, values = read_rows(k_cache, bucket, k_scale), read_rows(v_cache, bucket, v_scale)
        out[bucket.rows] = attend_gathered(query[bucket.rows], keys, values, bucket.lengths, scale, shape)
    return out


def read_rows(cache: torch.Tensor, bucket: DecodeRows, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """A bucket's cache entries -> [rows, kv_heads, padded_len, head_dim] float32, the layout the attention matmuls
    take: converting and transposing in one copy saves the matmuls a second, strided one."""
    states = cache[bucket.slots].flatten(1, 2) if bucket.whole_blocks else cache.flatten(0, 1)[bucket.slots]
    if kv_scale is not None:
        states = read_kv(states, kv_scale, torch.float32)
    rows, padded_len, num_kv_heads, head_dim = states.shape
    gathered = torch.empty(rows, num_kv_heads, padded_len, head_dim, dtype=torch.float32, device=states.device)
    return gathered.copy_(states.transpose(1, 2))


def attend_gathered(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_lens: torch.Tensor, scale: float,
    shape: ScoreShape = PLAIN,
) -> torch.Tensor:
    """query [num_seqs, heads, head_dim] over float32 keys/values [num_seqs, kv_heads, max_len, head_dim], the first
    context_len of each; key index i is position i (a draft node's ancestors follow the real tokens in order), so a
    sliding window keeps the last `window` of them."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, max_len = keys.shape[1], keys.shape[2]
    grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
    scores = shape.capped(grouped @ keys.transpose(-1, -2) * scale)
    key_positions = torch.arange(max_len, device=query.device)[None, :]
    masked = key_positions >= context_lens[:, None]
    if shape.window is not None:
        masked |= key_positions < context_lens[:, None] - shape.window
    scores.masked_fill_(masked[:, None, None, :], float("-inf"))
    out = scores.softmax(-1) @ values
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def prefill_attention_reference(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    context_len: int, scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    shape: ScoreShape = PLAIN,
) -> torch.Tensor:
    """A chunk of one sequence's queries against its cached prefix and itself, causally (within the window)."""
    query_len = query.shape[0]
    keys = read_kv(gather_kv(k_cache, block_table, context_len), k_scale, query.dtype).transpose(0, 1)
    values = read_kv(gather_kv(v_cache, block_table, context_len), v_scale, query.dtype).transpose(0, 1)
    if shape.softcap is not None:  # SDPA has no soft cap; scores in float32, as decode computes them
        visible = visible_keys(query_len, context_len, shape.window, query.device)
        out, _ = softcapped_attention(query.transpose(0, 1)[None].float(), keys[None].float(), values[None].float(), visible,
                                      scale, shape.softcap)
        return out[0].to(query.dtype)
    if query_len == context_len and shape.window is None:
        mask, is_causal = None, True
    else:
        mask, is_causal = visible_keys(query_len, context_len, shape.window, query.device), False
    # batched 4-D inputs: torch's CPU flash kernel takes them (grouped heads too), 3-D ones fall to the unfused math path
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """How decode rows read the paged cache; every backend computes a row's result from that row alone.
    decode: one query per sequence, over its keys by its block table (decode_attention_reference's contract);
    attend_rows: rows over their own key slots (draft trees), in the arithmetic of decode, so a draft row gets
    decoding's bits (attend_rows' contract); prepares_decode_rows: whether the runner buckets a step's plain decode
    rows once for every layer (AttentionMetadata.decode_rows), where the kernel does not walk the block tables itself."""

    name: str
    decode: Callable[..., torch.Tensor]
    attend_rows: Callable[..., torch.Tensor]
    prepares_decode_rows: bool


# the torch reference: decode rows bucketed by padded length, worked out once a step rather than in every layer
REFERENCE_ATTENTION = AttentionBackend("reference", decode_attention_reference, attend_rows, prepares_decode_rows=True)


@dataclass(frozen=True, slots=True)
class NVFP4KVRounding:
    """An NVFP4 KV cache served in the compute dtype: keys and values are rounded to what NVFP4 stores (groups of 16
    features, their float8 scales under the calibrated global scale) before they are stored, so attention reads the
    values an NVFP4 cache holds; the cache takes the compute dtype's memory, not NVFP4's."""

    args: QuantArgs
    k_global_scale: torch.Tensor
    v_global_scale: torch.Tensor

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fake_quantize_activation(k, self.args, self.k_global_scale), fake_quantize_activation(v, self.args, self.v_global_scale)


@dataclass(frozen=True, slots=True)
class LayerKVCache:
    """One layer's part of the paged KV cache, keys and values [num_blocks, block_size, kv_heads, head_dim] each, and
    for an FP8 cache the per-KV-head float32 scales its entries are stored divided by (for NVFP4, its rounding)."""

    keys: torch.Tensor
    values: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    nvfp4: NVFP4KVRounding | None = None


class PagedAttention(nn.Module):
    def __init__(self, scale: float, shape: ScoreShape, backend: AttentionBackend, cache: LayerKVCache):
        super().__init__()
        self.scale, self.shape, self.backend, self.cache = scale, shape, backend, cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        keys, values, k_scale, v_scale = self.cache.keys, self.cache.values, self.cache.k_scale, self.cache.v_scale
        if self.cache.nvfp4 is not None:
            k, v = self.cache.nvfp4(k, v)
        store_kv(keys, metadata.slot_mapping, k, k_scale)
        store_kv(values, metadata.slot_mapping, v, v_scale)
        num_decodes = metadata.num_decodes
        outputs = []
        if metadata.decode_rows is not None:
            outputs.append(self.backend.attend_rows(
                q[:num_decodes], keys, values, metadata.decode_rows, self.scale, k_scale, v_scale, self.shape,
            ))
        elif num_decodes:
            outputs.append(self.backend.decode(
                q[:num_decodes], keys, values, metadata.block_tables[:num_decodes], metadata.context_lens[:num_decodes],
                self.scale, k_scale, v_scale, self.shape,
            ))
        start = num_decodes
        for index in range(num_decodes, len(metadata.query_lens)):
            end = start + metadata.query_lens[index]
            context_len = metadata.seq_lens[index]
            num_blocks = cdiv(context_len, keys.shape[1])
            block_table = metadata.block_tables[index, :num_blocks]
            outputs.append(prefill_attention_reference(
                q[start:end], keys, values, block_table, context_len, self.scale, k_scale, v_scale, self.shape,
            ))
            start = end
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]
