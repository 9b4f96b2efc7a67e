"""EAGLE draft: one decoder layer over fc([feature; embedding of the next token]) predicting the target's next final
feature; the target's frozen LM head turns a predicted feature into token guesses, and its embedding is shared too."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmc.runtime.layers.rotary import rotate_half


@dataclass(slots=True)
class EagleShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    draft_vocab_size: int  # the draft guesses among these many tokens: a cheaper LM head


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [..., tokens, heads, head_dim] with cos, sin [..., tokens, 1, head_dim] of their positions."""
    return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)


class EagleDraft(nn.Module):
    def __init__(self, shape: EagleShape):
        super().__init__()
        hidden, self.shape = shape.hidden_size, shape
        self.head_dim = hidden // shape.num_heads
        kv_size = shape.num_kv_heads * self.head_dim
        self.fc = nn.Linear(2 * hidden, hidden)
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, kv_size, bias=False)
        self.v_proj, self.o_proj = nn.Linear(hidden, kv_size, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=shape.rms_norm_eps)
        self.gate_proj = nn.Linear(hidden, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, hidden, bias=False)
        self.register_buffer("vocab", torch.zeros(shape.draft_vocab_size, dtype=torch.long))  # token id of each draft guess
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        self.inv_freq = 1.0 / shape.rope_theta**exponents  # not a buffer: it stays float32 when the layer is cast

    @property
    def num_kv_heads(self) -> int:
        return self.shape.num_kv_heads

    def forward(
        self, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """features, embeddings [batch, tokens, hidden] (the token after each feature), positions [batch, tokens],
        mask [tokens, past + tokens] (True: attend), past keys/values [batch, past, kv_heads, head_dim].
        Returns the predicted next features and these tokens' keys and values."""
        batch, tokens, _ = features.shape
        x = self.fc(torch.cat([features, embeddings], -1))
        angles = positions[..., None].float() * self.inv_freq.to(positions.device)
        cos, sin = torch.cat([angles.cos()] * 2, -1)[..., None, :], torch.cat([angles.sin()] * 2, -1)[..., None, :]
        q = rotate(self.q_proj(x).view(batch, tokens, -1, self.head_dim), cos, sin)
        k = rotate(self.k_proj(x).view(batch, tokens, -1, self.head_dim), cos, sin)
        v = self.v_proj(x).view(batch, tokens, -1, self.head_dim)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 1), torch.cat([past[1], v], 1))
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        x = x + self.o_proj(attended.transpose(1, 2).flatten(2))
        mlp_in = self.post_attention_layernorm(x.to(self.post_attention_layernorm.weight.dtype))  # float32 under autocast
        return x + self.down_proj(F.silu(self.gate_proj(mlp_in)) * self.up_proj(mlp_in)), k, v
