"""EAGLE-3 draft: `fc` fuses the target's residual stream entering three of its layers (low, middle, high) into one
feature, each layer's first RMS-normed on its own (`fc_norm`: the residual stream's few massive channels grow
tenfold from the low layer to the high one, and unnormed they swamp what fc learns from the rest); one decoder
layer attends over [normed embedding of the next token; normed feature] and its own normed LM head guesses among
the draft vocabulary. Later drafting steps feed the layer's own output (before the final norm) back in as the
feature; the layer's residual stream starts from the normed feature (`norm_before_residual`), so a fed-back
output enters at the scale of a fused one. The parameter names, the config and the arithmetic are those of
vLLM's `Eagle3LlamaForCausalLM`, so the same weights serve in both engines."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from llmc.runtime.layers.rotary import rotate_half

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's choice (and vLLM's default): the residual stream entering layer 2, the middle layer and the third from
    last, in vLLM's numbering (0: the embeddings, num_layers: the last layer's output); distinct on a shallow model."""
    return sorted({min(2, num_layers), num_layers // 2, max(num_layers - 3, 0)})


def eagle3_config(target, aux_layer_ids: list[int], draft_vocab_size: int) -> LlamaConfig:
    """The draft's config.json: one Llama layer of the target's sizes, with vLLM's EAGLE-3 fields."""
    head_dim = getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads
    rope = dict(getattr(target, "rope_parameters", None) or {"rope_type": "default", "rope_theta": target.rope_theta})
    return LlamaConfig(
        architectures=[ARCHITECTURE], hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads, head_dim=head_dim,
        num_hidden_layers=1, rms_norm_eps=target.rms_norm_eps, rope_parameters=rope,
        max_position_embeddings=target.max_position_embeddings, vocab_size=target.vocab_size, tie_word_embeddings=False,
        draft_vocab_size=draft_vocab_size, target_hidden_size=target.hidden_size,
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids), fc_norm=True, norm_before_residual=True,
        dtype="bfloat16",
    )


class Eagle3Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(2 * config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)


class Eagle3Mlp(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Eagle3Mlp(config)


def normed(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm in its weight's dtype (float32 under autocast), back in x's."""
    return norm(x.to(norm.weight.dtype)).to(x.dtype)


class Eagle3Draft(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        aux_layers = config.eagle_aux_hidden_state_layer_ids
        self.fc = nn.Linear(len(aux_layers) * config.target_hidden_size, config.hidden_size, bias=False)
        # drafts of earlier llmc have neither field: fc reads the features as they are, the residual starts raw
        self.fc_norm = nn.ModuleList(
            [nn.RMSNorm(config.target_hidden_size, eps=config.rms_norm_eps) for _ in aux_layers]
        ) if getattr(config, "fc_norm", False) else None
        self.norm_before_residual = getattr(config, "norm_before_residual", False)
        self.midlayer = Eagle3Layer(config)
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # vLLM's vocabulary maps: draft index i guesses token i + d2t[i]; t2d marks the tokens the draft can guess
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        rotary = LlamaRotaryEmbedding(config)  # transformers' RoPE for the config's scaling
        # plain tensors, not buffers: they stay float32 when the layer is cast
        self.inv_freq, self.rope_scaling = rotary.inv_freq.float(), rotary.attention_scaling

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def vocab(self) -> torch.Tensor:
        """The token id of each draft guess."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def set_vocab(self, vocab: torch.Tensor) -> None:
        self.d2t.copy_(vocab - torch.arange(len(vocab)))
        self.t2d.zero_()
        self.t2d[vocab] = True

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., layers * target_hidden] -> the feature the first drafting step reads [..., hidden]."""
        if self.fc_norm is not None:  # in float32, as vLLM norms: the massive channels reach the hundreds
            chunks = aux.chunk(len(self.fc_norm), -1)
            aux = torch.cat([F.rms_norm(chunk.float(), norm.normalized_shape, norm.weight.float(), norm.eps).to(aux.dtype)
                             for norm, chunk in zip(self.fc_norm, chunks)], -1)
        return self.fc(aux)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output -> logits over the draft vocabulary."""
        return self.lm_head(normed(self.norm, out))

    def forward(
        self, hidden: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden, embeddings [batch, tokens, hidden] (the token after each feature), positions [batch, tokens], mask
        [tokens, past + tokens] (True: attend), past keys/values [batch, past, kv_heads, head_dim]. Returns the
        layer's outputs (before the final norm: the next step's features) and these tokens' keys and values."""
        layer, attention = self.midlayer, self.midlayer.self_attn
        batch, tokens, _ = hidden.shape
        feature = normed(layer.hidden_norm, hidden)
        if self.norm_before_residual:
            hidden = feature
        x = torch.cat([normed(layer.input_layernorm, embeddings), feature], -1)
        angles = positions[..., None].float() * self.inv_freq.to(positions.device)
        cos = (torch.cat([angles.cos()] * 2, -1) * self.rope_scaling)[..., None, :]
        sin = (torch.cat([angles.sin()] * 2, -1) * self.rope_scaling)[..., None, :]
        q = attention.q_proj(x).view(batch, tokens, -1, self.head_dim)
        k = attention.k_proj(x).view(batch, tokens, -1, self.head_dim)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(q.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(k.dtype)
        v = attention.v_proj(x).view(batch, tokens, -1, self.head_dim)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 1), torch.cat([past[1], v], 1))
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        residual = hidden + attention.o_proj(attended.transpose(1, 2).flatten(2))
        return residual + layer.mlp(normed(layer.post_attention_layernorm, residual)), k, v
