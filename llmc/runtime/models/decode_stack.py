"""Which models' decode steps the fused C++ decoder stack (layers/cpu_decode_stack.py) serves, and the stack built from
a model's layers: their norms, rotary tables, KV cache and 4-bit Linears handed to C++ once, at start."""
import torch
from torch import nn

from llmc.runtime.layers import cpu_decode_stack
from llmc.runtime.layers.attention import AttentionMetadata
from llmc.runtime.layers.cpu_fp4_gemm import Fp4CpuLinear
from llmc.runtime.layers.cpu_nibble_gemv import NibbleMatmul
from llmc.runtime.layers.linear import Int4CpuLinear
from llmc.runtime.models.llama import LlamaForCausalLM, LlamaMLP


def nibble_matmul(linear: nn.Module) -> NibbleMatmul | None:
    if isinstance(linear, Int4CpuLinear) and isinstance(linear.matmul, NibbleMatmul):
        return linear.matmul
    if isinstance(linear, Fp4CpuLinear):
        return linear.nibbles
    return None


def layer_linears(layer: nn.Module) -> list[nn.Module]:
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]


def refusal(model: LlamaForCausalLM, kv_dtype: torch.dtype, dtype: torch.dtype) -> str | None:
    """Why the stack cannot serve this model's decode steps; None where it can."""
    arch = model.arch
    if dtype != torch.bfloat16 or kv_dtype != dtype:
        return "it runs bfloat16 with a bfloat16 KV cache"
    if not arch.plain_attention or arch.family.sandwich_norms or arch.embedding_scale is not None:
        return "the layers are not plain pre-norm attention"
    if arch.activation != "silu" or arch.family.norm_offset:
        return "the MLP or the norms are not Llama's"
    if arch.head_dim > cpu_decode_stack.MAX_HEAD_DIM:
        return f"the heads are wider than {cpu_decode_stack.MAX_HEAD_DIM}"
    for layer in model.layers:
        cache = layer.self_attn.attn.cache
        if not isinstance(layer.mlp, LlamaMLP) or cache.nvfp4 is not None or cache.k_scale is not None:
            return "a layer has experts or a quantized KV cache"
        linears = layer_linears(layer)
        if any(nibble_matmul(linear) is None for linear in linears) or any(linear.bias is not None for linear in linears[1:]):
            return "a Linear is not 4-bit on the nibble kernel"
    module = cpu_decode_stack.KERNEL.get()
    if module is None or not module.available():
        return "the C++ stack does not build here"
    return None


class DecodeStack:
    """The model's decoder layers as one C++ DecodeStack, for decode-only steps of at most max_rows rows."""

    def __init__(self, model: LlamaForCausalLM, max_rows: int):
        first = model.layers[0]
        self.max_rows = max_rows
        self.stack = cpu_decode_stack.KERNEL.get().DecodeStack(
            first.input_layernorm.weight.shape[0], first.self_attn.num_heads, first.self_attn.num_kv_heads, model.arch.head_dim,
            first.input_layernorm.eps, model.arch.attention_scale,
        )
        empty = torch.empty(0)
        for layer in model.layers:
            attention = layer.self_attn
            linears = layer_linears(layer)
            matmuls = [nibble_matmul(linear) for linear in linears]
            q_k_norms = [attention.q_norm.weight, attention.k_norm.weight] if attention.q_norm is not None else [empty, empty]
            rope = [attention.rotary.cos, attention.rotary.sin] if attention.rotary is not None else [empty, empty]
            self.stack.add_layer(
                [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *q_k_norms], rope,
                attention.attn.cache.keys, attention.attn.cache.values,
                [matmul.codes for matmul in matmuls], [matmul.scales for matmul in matmuls], [matmul.table for matmul in matmuls],
                [matmul.group_size for matmul in matmuls], [linear.bias for linear in linears],
            )

    def covers(self, metadata: AttentionMetadata) -> bool:
        """Whether every row of the step decodes one token, plainly (no draft rows), and there are few enough."""
        rows = len(metadata.query_lens)
        return metadata.num_decodes == rows <= self.max_rows and metadata.decode_rows is None

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """The embeddings [rows, hidden] of a decode step -> the last layer's output (the K/V go into the cache)."""
        return self.stack.forward(hidden, positions, metadata.slot_mapping, metadata.block_tables, metadata.context_lens)
