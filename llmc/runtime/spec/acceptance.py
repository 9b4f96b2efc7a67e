"""Deciding which draft tokens the target keeps: exact match for greedy, rejection sampling otherwise (the output
follows the target's distribution exactly, whatever the draft proposed)."""
import torch


def greedy_accept(target_tokens: list[int], draft_tokens: list[int]) -> int:
    """How many drafts equal the target's own argmax at their position."""
    for index, (target, draft) in enumerate(zip(target_tokens, draft_tokens)):
        if target != draft:
            return index
    return len(draft_tokens)


def rejection_sample(
    target_probs: torch.Tensor, draft_tokens: list[int], draft_probs: torch.Tensor, generator: torch.Generator | None
) -> list[int]:
    """target_probs [k + 1, vocab], draft_probs [k, vocab] -> the accepted drafts plus one recovered or bonus token.
    Draft i is kept with probability min(1, p(x) / q(x)); the first rejected one is replaced by a draw from
    normalise(max(p - q, 0)); when all are kept, a bonus token is drawn from the last target row."""
    accepted = []
    for index, token in enumerate(draft_tokens):
        p, q = target_probs[index, token], draft_probs[index, token]
        if torch.rand((), generator=generator) * q < p:
            accepted.append(token)
            continue
        residual = (target_probs[index] - draft_probs[index]).clamp(min=0)
        return accepted + [int(torch.multinomial(residual / residual.sum(), 1, generator=generator))]
    return accepted + [int(torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator))]
