"""Medusa heads: K residual SiLU blocks on the target's last hidden state, each with its own vocabulary projection;
head k guesses the token k + 2 ahead. The projections cover the draft vocabulary (the answers' most frequent tokens)
and start as those rows of the target's LM head, so every head starts as an exact copy of the target's next-token
guess and then learns its own."""
import torch
import torch.nn.functional as F
from torch import nn


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # starts as the identity
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, draft_vocab_size: int):
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(hidden_size) for _ in range(num_heads))
        self.projections = nn.ModuleList(nn.Linear(hidden_size, draft_vocab_size, bias=False) for _ in range(num_heads))
        self.register_buffer("vocab", torch.zeros(draft_vocab_size, dtype=torch.long))  # token id of each draft guess

    @classmethod
    def from_lm_head(cls, lm_head: torch.Tensor, vocab: torch.Tensor, num_heads: int) -> "MedusaHeads":
        """Heads over the draft vocabulary `vocab` (token ids), projections initialised from lm_head [vocab, hidden]."""
        heads = cls(lm_head.shape[1], num_heads, len(vocab))
        heads.vocab.copy_(vocab)
        with torch.no_grad():
            for projection in heads.projections:
                projection.weight.copy_(lm_head[vocab])
        return heads

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[N, hidden] -> logits over the draft vocabulary [num_heads, N, draft_vocab] of the first num_heads (default all)."""
        pairs = list(zip(self.blocks, self.projections))[:num_heads]
        return torch.stack([projection(block(hidden)) for block, projection in pairs])
