"""One forward for every dense family the runtime serves (Llama, Mistral, Qwen2/3, SmolLM3, Gemma 2/3, Phi-3) and
the mixture-of-experts ones (Mixtral, Qwen3-MoE: layers/moe.py), built from config.json and the artifact's
tensors. What sets a family apart (q/k norms, biases, soft-capping, sliding windows, norm offsets, the activation,
layers without RoPE, fused projections) is an option the config and the family's record turn on
(models/architecture.py). The attention backend and the KV cache are given at construction (engine/kernel_policy.py
chooses the backend)."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from llmc.core.errors import LlmcError
from llmc.runtime.layers.attention import AttentionBackend, AttentionMetadata, LayerKVCache, PagedAttention, ScoreShape
from llmc.runtime.layers.linear import DenseLinear
from llmc.runtime.layers.linear_weight import LinearWeight
from llmc.runtime.layers.moe import moe_block
from llmc.runtime.layers.norm import RMSNorm
from llmc.runtime.layers.rotary import RotaryEmbedding
from llmc.runtime.models.architecture import Architecture, architecture_of
from llmc.runtime.models.loader import WeightLoader


def rms_norm(weights: WeightLoader, name: str, eps: float, arch: Architecture) -> RMSNorm:
    return RMSNorm(weights.tensor(f"{name}.weight"), eps, arch.family.norm_offset)


@dataclass(frozen=True)
class LayerContext:
    """What every decoder layer is built from: the config, what sets its family apart, its weights, and the attention
    backend with the whole KV cache [2, layers, blocks, block_size, kv_heads, head_dim] its layers attend over."""

    config: PretrainedConfig
    arch: Architecture
    weights: WeightLoader
    attention: AttentionBackend
    kv_cache: torch.Tensor


class LlamaAttention(nn.Module):
    def __init__(self, context: LayerContext, index: int, rotary: RotaryEmbedding | None):
        super().__init__()
        config, arch, weights = context.config, context.arch, context.weights
        layer = f"{arch.family.layers}.{index}"
        prefix = f"{layer}.self_attn"
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = arch.head_dim
        self.qkv_proj = weights.linear([f"{layer}.{name}" for name in arch.family.qkv])
        self.o_proj = weights.linear([f"{prefix}.o_proj"])
        self.q_norm = self.k_norm = None
        if f"{prefix}.q_norm.weight" in weights:  # Qwen3, Gemma 3: each head's q and k normed before RoPE
            self.q_norm = rms_norm(weights, f"{prefix}.q_norm", config.rms_norm_eps, arch)
            self.k_norm = rms_norm(weights, f"{prefix}.k_norm", config.rms_norm_eps, arch)
        self.rotary = rotary  # None: a layer without positions (SmolLM3)
        shape = ScoreShape(arch.sliding_windows[index], arch.attention_softcap)
        k_scale, v_scale = weights.kv_scales(prefix, self.num_kv_heads) or (None, None)
        cache = LayerKVCache(context.kv_cache[0, index], context.kv_cache[1, index], k_scale, v_scale, weights.kv_rounding(prefix))
        self.attn = PagedAttention(arch.attention_scale, shape, context.attention, cache)

    def project(self, positions: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (normed and rotated as the family does) and v of each token: [tokens, heads, head_dim]."""
        qkv = self.qkv_proj(hidden).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        query_keys = qkv[:, : self.num_heads + self.num_kv_heads]
        if self.q_norm is not None:
            queries, keys = query_keys.split([self.num_heads, self.num_kv_heads], dim=1)
            query_keys = torch.cat([self.q_norm(queries), self.k_norm(keys)], dim=1)
        if self.rotary is not None:
            query_keys = self.rotary(positions, query_keys)
        q, k = query_keys.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, qkv[:, self.num_heads + self.num_kv_heads :]


class LlamaMLP(nn.Module):
    def __init__(self, layer: str, weights: WeightLoader, arch: Architecture):
        super().__init__()
        self.gate_up_proj = weights.linear([f"{layer}.{name}" for name in arch.family.gate_up])
        self.down_proj = weights.linear([f"{layer}.mlp.down_proj"])
        self.act_fn = ACT2FN[arch.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, context: LayerContext, index: int, rotary: RotaryEmbedding | None):
        super().__init__()
        config, arch, weights = context.config, context.arch, context.weights
        prefix, eps = f"{arch.family.layers}.{index}", config.rms_norm_eps
        self.input_layernorm = rms_norm(weights, f"{prefix}.input_layernorm", eps, arch)
        self.self_attn = LlamaAttention(context, index, rotary)
        self.post_attention_layernorm = rms_norm(weights, f"{prefix}.post_attention_layernorm", eps, arch)
        self.sandwich_norms = arch.family.sandwich_norms
        if self.sandwich_norms:  # post_attention_layernorm norms the attention's output; these the MLP's input and output
            self.pre_feedforward_layernorm = rms_norm(weights, f"{prefix}.pre_feedforward_layernorm", eps, arch)
            self.post_feedforward_layernorm = rms_norm(weights, f"{prefix}.post_feedforward_layernorm", eps, arch)
        self.mlp = moe_block(config, arch.family.moe, index, prefix, weights) or LlamaMLP(prefix, weights, arch)

    # the layer in three pieces: the two around the paged attention have static shapes but the number of tokens, so
    # they are what torch.compile compiles (engine/compiled.py); the attention reads the cache by each step's lengths
    def attention_inputs(self, positions: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.project(positions, self.input_layernorm(hidden))

    def attention_output(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        attention = self.self_attn.o_proj(attended.flatten(1))
        if self.sandwich_norms:
            hidden = hidden + self.post_attention_layernorm(attention)
            return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        hidden = hidden + attention
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.attention_inputs(positions, hidden)
        return self.attention_output(hidden, self.self_attn.attn(q, k, v, metadata))


def aux_layer_ids(layers, num_layers: int, what: str) -> tuple[int, ...]:
    """Layers whose entering residual stream is kept (0: the embeddings, num_layers: the last layer's output), in
    layer order, the order aux_hidden joins them in; LlmcError naming `what` when one is not a layer of the model."""
    if any(not 0 <= index <= num_layers for index in layers):
        raise LlmcError(f"{what} {list(layers)}: the model's layers are numbered 0..{num_layers}")
    return tuple(sorted(set(layers)))


class LlamaForCausalLM(nn.Module):
    """kv_cache: [2, layers, blocks, block_size, kv_heads, head_dim], the keys' and values' blocks of every layer;
    attention: how every layer's decode rows read them."""

    def __init__(self, config, weights: WeightLoader, max_position: int, attention: AttentionBackend, kv_cache: torch.Tensor):
        super().__init__()
        self.arch = arch = architecture_of(config)
        family = arch.family
        rotaries = {
            layer_type: RotaryEmbedding(config, max_position, weights.dtype, layer_type).to(weights.device)
            for layer_type in dict.fromkeys(arch.layer_types)
        }
        self.embed_tokens = nn.Parameter(weights.tensor(f"{family.embed_tokens}.weight"), requires_grad=False)
        context = LayerContext(config, arch, weights, attention, kv_cache)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(context, index, rotaries[arch.layer_types[index]] if arch.uses_rope[index] else None)
            for index in range(config.num_hidden_layers)
        )
        self.norm = rms_norm(weights, family.final_norm, config.rms_norm_eps, arch)
        if config.tie_word_embeddings:
            self.lm_head = DenseLinear(LinearWeight(self.embed_tokens.data), weights.dtype, weights.device)
        else:
            self.lm_head = weights.linear([family.lm_head])
        # EAGLE-3's auxiliary features: the residual stream entering these layers (len(layers): leaving the last),
        # joined in layer order into aux_hidden [tokens, len(aux_layer_ids) * hidden] by every forward
        self.aux_layer_ids: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed_tokens)
        if self.arch.embedding_scale is not None:  # rounded to the dtype first, as transformers does
            hidden = hidden * torch.tensor(self.arch.embedding_scale, dtype=hidden.dtype)
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden, aux = self.embed(input_ids), []
        for index, layer in enumerate(self.layers):
            if index in self.aux_layer_ids:
                aux.append(hidden)
            hidden = layer(positions, hidden, metadata)
        if len(self.layers) in self.aux_layer_ids:
            aux.append(hidden)
        self.aux_hidden = torch.cat(aux, -1) if aux else None
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.arch.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
