"""EAGLE draft: one decoder layer over fc([feature; embedding of the next token]) predicting the target's next final
feature; the target's frozen LM head turns a predicted feature into token guesses, and its embedding is shared too."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmc.runtime.layers.rotary import rotate_half

TOKEN_LOSS_WEIGHT = 0.1  # the token loss through the LM head, next to the feature regression
OUT_OF_VOCAB = -1  # label of a token the draft cannot guess: its feature is learned, not the token
INPUT_NOISE = 0.2  # uniform noise on input features in training, in units of the features' RMS: drafting feeds its own guesses back


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

    def unrolled(self, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor, unroll: int) -> list[torch.Tensor]:
        """Windows of `tokens` pairs drafted `unroll` steps deep as in serving (EAGLE-3's training-time test): step
        s > 0 feeds the features step s - 1 predicted back in with the tokens after them, attending to the true
        pairs before it and to its own chain of guesses. features [batch, tokens, hidden], embeddings [batch,
        tokens + unroll - 1, hidden] of the token after each feature, positions [batch, tokens] of the pairs.
        Returns each step's predicted features [batch, tokens, hidden]: step s at row i guesses feature i + s + 1."""
        tokens = positions.shape[1]
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=features.device).tril()
        own_chain = torch.eye(tokens, dtype=torch.bool, device=features.device)
        inputs, past, steps = features, None, []
        for step in range(unroll):
            mask = torch.cat([causal] + [own_chain] * step, 1)
            inputs, keys, values = self(inputs, embeddings[:, step : step + tokens], positions + step, mask, past)
            past = (keys, values) if past is None else (torch.cat([past[0], keys], 1), torch.cat([past[1], values], 1))
            steps.append(inputs)
        return steps

    def loss(self, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor,
             lm_head: torch.Tensor, noise_scale: float, unroll: int) -> torch.Tensor:
        """`unrolled` on noisy features, each step's feature regression plus token loss averaged. features [batch,
        tokens + unroll, hidden] the target's, labels [batch, tokens + unroll - 1] the token after each next
        feature as an index into lm_head (-100: no loss, OUT_OF_VOCAB: the feature loss only), lm_head [vocab,
        hidden] frozen, the draft vocabulary's rows."""
        tokens = positions.shape[1]
        inputs = features[:, :tokens]
        noisy = inputs + (torch.rand_like(inputs) - 0.5) * INPUT_NOISE * noise_scale
        total = features.new_zeros(())
        for step, predicted in enumerate(self.unrolled(noisy, embeddings, positions, unroll)):
            step_labels = labels[:, step : step + tokens]
            answer, in_vocab = step_labels != -100, step_labels >= 0
            feature_loss = F.smooth_l1_loss(predicted[answer], features[:, step + 1 : step + 1 + tokens][answer])
            token_loss = F.cross_entropy(predicted[in_vocab] @ lm_head.T, step_labels[in_vocab])
            total = total + feature_loss + TOKEN_LOSS_WEIGHT * token_loss
        return total / unroll
