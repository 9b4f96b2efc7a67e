"""Proposers turn what a step observed into the next draft tree of each sequence that emitted tokens."""
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch
from torch import nn

from llmc.draft.eagle import EagleDraft
from llmc.errors import LlmcError
from llmc.runtime.config import EngineConfig
from llmc.runtime.models.llama import LlamaForCausalLM
from llmc.runtime.sequence import Sequence
from llmc.runtime.spec.tree import ROOT, DraftTree

EAGLE_DEPTH = 5  # default draft depth
EAGLE_TOP_K = 4  # tokens expanded per node, and paths kept per level, when drafting a tree


@dataclass(slots=True)
class Observed:
    """What one step taught about a sequence: the target's features of tokens whose next token is now known."""

    seq: Sequence
    first_position: int  # position of the first feature
    features: torch.Tensor  # [n, hidden], consecutive positions
    next_token_ids: list[int]  # the token that followed each feature's position
    sampled: bool  # the step emitted tokens for it: it needs a new draft


class MedusaProposer:
    """A chain of each head's top-1 guess from the last kept feature."""

    def __init__(self, heads: nn.Module, model: LlamaForCausalLM, num_tokens: int):
        self.heads, self.compute_logits = heads, model.compute_logits
        self.max_depth = num_tokens

    def propose(self, observed: list[Observed], drafting: bool) -> dict:
        sampled = [item for item in observed if item.sampled]
        if not drafting or not sampled:
            return {}
        last = torch.stack([item.features[-1] for item in sampled])
        guesses = self.compute_logits(self.heads(last)[: self.max_depth].flatten(0, 1)).argmax(-1).view(self.max_depth, -1)
        return {item.seq: DraftTree.chain(guesses[:, column].tolist()) for column, item in enumerate(sampled)}


@dataclass(slots=True)
class EagleCache:
    """The draft layer's keys and values over a sequence's (feature, next token) pairs, and its last prediction."""

    keys: torch.Tensor  # [1, pairs, kv_heads, head_dim]
    values: torch.Tensor
    next_position: int
    last_output: torch.Tensor | None = None  # the predicted feature after the last pair


class EagleProposer:
    """Feeds every (feature, next token) pair the target computes into the EAGLE layer, then drafts a tree from its
    last prediction: each level expands the top_k tokens of every node of the level above, keeps the top_k most
    probable paths (the product of the draft's own probabilities, EAGLE-2's confidence) and feeds their predicted
    features back in; the num_nodes most probable nodes are proposed. top_k 1 drafts a chain."""

    def __init__(self, draft: EagleDraft, model: LlamaForCausalLM, depth: int, num_nodes: int, top_k: int):
        self.draft, self.model = draft, model
        hidden_size = draft.shape.hidden_size
        identity = torch.eye(hidden_size, dtype=model.embed_tokens.dtype, device=model.embed_tokens.device)
        self.lm_head = model.compute_logits(identity)[:, draft.vocab].T.contiguous()  # the draft vocabulary's rows
        self.max_depth, self.num_nodes, self.top_k = depth, num_nodes, top_k
        self.caches: WeakKeyDictionary[Sequence, EagleCache] = WeakKeyDictionary()

    def propose(self, observed: list[Observed], drafting: bool) -> dict:
        """Under load nothing is fed either: a sequence that drafts again later attends to the pairs seen while drafting."""
        if not drafting:
            return {}
        trees = {}
        for item in observed:
            cache = self._commit(item)
            if item.sampled and cache.last_output is not None:
                trees[item.seq] = self._draft(cache)
        return trees

    def _commit(self, item: Observed) -> EagleCache:
        empty = torch.empty(1, 0, self.draft.shape.num_kv_heads, self.draft.head_dim, dtype=item.features.dtype, device=item.features.device)
        cache = self.caches.setdefault(item.seq, EagleCache(empty, empty, item.first_position))
        skip = max(0, cache.next_position - item.first_position)  # recomputed after a preemption: already in
        features, token_ids = item.features[skip:], item.next_token_ids[skip : len(item.features)]
        if not len(features):
            return cache
        start = max(cache.next_position, item.first_position)
        positions = torch.arange(start, start + len(features), device=features.device)
        mask = torch.ones(len(features), cache.keys.shape[1] + len(features), dtype=torch.bool, device=features.device)
        mask[:, cache.keys.shape[1] :] = mask[:, cache.keys.shape[1] :].tril()
        embedded = self.model.embed_tokens[torch.tensor(token_ids, device=features.device)]
        out, keys, values = self.draft(features[None], embedded[None], positions[None], mask, (cache.keys, cache.values))
        cache.keys, cache.values = torch.cat([cache.keys, keys], 1), torch.cat([cache.values, values], 1)
        cache.next_position, cache.last_output = start + len(features), out[0, -1]
        return cache

    def _draft(self, cache: EagleCache) -> DraftTree:
        tree, scores = DraftTree(), []
        keys, values = cache.keys, cache.values
        frontier, frontier_features, frontier_scores = [ROOT], cache.last_output[None], torch.zeros(1)
        for depth in range(1, self.max_depth + 1):
            logprobs = (frontier_features @ self.lm_head.T).float().log_softmax(-1).cpu()
            top = logprobs.topk(self.top_k, dim=-1)
            candidates = (frontier_scores[:, None] + top.values).flatten()
            best = candidates.topk(min(self.top_k, len(candidates))).indices.tolist()
            level = range(len(tree), len(tree) + len(best))
            token_ids = self.draft.vocab[top.indices.flatten()].tolist()
            for index in best:
                tree.tokens.append(token_ids[index])
                tree.parents.append(frontier[index // self.top_k])
                scores.append(float(candidates[index]))
            if depth == self.max_depth:
                break
            parent_rows = [frontier.index(tree.parents[node]) for node in level]
            visible = torch.ones(len(level), cache.keys.shape[1] + len(tree), dtype=torch.bool)
            visible[:, cache.keys.shape[1] :] = False
            for row, node in enumerate(level):
                visible[row, [cache.keys.shape[1] + ancestor for ancestor in tree.path(node)]] = True
            embedded = self.model.embed_tokens[torch.tensor([tree.tokens[node] for node in level])]
            positions = torch.full((1, len(level)), cache.next_position + depth - 1)
            out, new_keys, new_values = self.draft(
                frontier_features[parent_rows][None], embedded[None], positions, visible.to(keys.device), (keys, values)
            )
            keys, values = torch.cat([keys, new_keys], 1), torch.cat([values, new_values], 1)
            frontier, frontier_features, frontier_scores = list(level), out[0], torch.tensor([scores[node] for node in level])
        return most_probable_nodes(tree, scores, self.num_nodes)


def most_probable_nodes(tree: DraftTree, scores: list[float], num_nodes: int) -> DraftTree:
    """The num_nodes nodes of highest path probability, parents first; a path is never likelier than its parent,
    so the kept nodes form a tree."""
    depths = tree.depths
    kept = sorted(sorted(range(len(tree)), key=lambda node: (-scores[node], depths[node]))[:num_nodes])
    renumbered = {old: new for new, old in enumerate(kept)} | {ROOT: ROOT}
    return DraftTree([tree.tokens[node] for node in kept], [renumbered[tree.parents[node]] for node in kept])


def build_proposer(draft_config: dict, heads: nn.Module, model: LlamaForCausalLM, config: EngineConfig):
    if draft_config["method"] == "medusa":
        return MedusaProposer(heads, model, min(config.num_speculative_tokens or heads.num_heads, heads.num_heads))
    if draft_config["method"] == "eagle":
        depth = config.num_speculative_tokens or EAGLE_DEPTH
        num_nodes = max(config.speculative_tree_nodes, depth)
        return EagleProposer(heads, model, depth, num_nodes, EAGLE_TOP_K if num_nodes > depth else 1)
    raise LlmcError(f"unknown draft method {draft_config['method']!r}")
