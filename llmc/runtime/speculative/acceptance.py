"""Deciding which draft tokens the target keeps, walking the draft tree from the sequence's last token: exact match
with the target's argmax for greedy, rejection sampling otherwise, so the output follows the target's distribution
exactly whatever the drafts were."""
import torch

from llmc.runtime.engine.draft_tree import ROOT, DraftTree


def greedy_accept(target_tokens: list[int], tree: DraftTree) -> list[int]:
    """target_tokens[0] is the target's argmax after the last token, target_tokens[1 + n] after node n.
    Returns the accepted path: nodes whose token is the target's choice after their parent."""
    path, node = [], ROOT
    while (child := next((c for c in tree.children(node) if tree.tokens[c] == target_tokens[node + 1]), None)) is not None:
        path.append(child)
        node = child
    return path


def rejection_sample(target_probs: torch.Tensor, tree: DraftTree, generator: torch.Generator | None) -> tuple[list[int], int]:
    """target_probs [1 + len(tree), vocab] (row 0 after the last token, row 1 + n after node n) -> (accepted path,
    the token drawn after it). Drafts are the proposer's top guesses, a deterministic q: a child x is kept with
    probability min(1, p(x) / q(x)) = p(x); on rejection p becomes normalise(max(p - q, 0)), p without x, and the next
    sibling is tried; when none is kept the token is drawn from what remains of p (at a leaf: the bonus token)."""
    path, node = [], ROOT
    while True:
        probs = target_probs[node + 1].clone()
        for child in tree.children(node):
            token = tree.tokens[child]
            if torch.rand((), generator=generator) < probs[token]:
                path.append(child)
                node = child
                break
            probs[token] = 0
            probs /= probs.sum()
        else:
            return path, int(torch.multinomial(probs, 1, generator=generator))
