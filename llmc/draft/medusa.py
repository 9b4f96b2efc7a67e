"""Medusa heads: K residual SiLU blocks on the target's last hidden state; head k guesses the token k + 2 ahead.
Every head projects through the target's own LM head, frozen, so the heads are small and start as exact copies of
the target's next-token guess."""
import torch
import torch.nn.functional as F
from torch import nn

LOSS_DECAY = 0.8  # weight of head k is LOSS_DECAY ** k: far guesses are rarely accepted, so they matter less


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # starts as the identity
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(hidden_size) for _ in range(num_heads))

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [num_heads, N, hidden], to go through the LM head."""
        return torch.stack([block(hidden) for block in self.blocks])

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden], labels [N, num_heads] (-100 past the sequence end), lm_head [vocab, hidden] frozen."""
        logits = self(hidden) @ lm_head.T
        losses = [F.cross_entropy(logits[k], labels[:, k], ignore_index=-100) for k in range(self.num_heads)]
        return sum(LOSS_DECAY**k * loss for k, loss in enumerate(losses))


def medusa_labels(token_ids: list[int], start: int, num_heads: int) -> torch.Tensor:
    """Row t (from start) holds the tokens at t + 2, ..., t + num_heads + 1 that the heads must guess."""
    rows = [[token_ids[t + k + 2] if t + k + 2 < len(token_ids) else -100 for k in range(num_heads)]
            for t in range(start, len(token_ids) - 1)]
    return torch.tensor(rows, dtype=torch.long)
