"""Proposers turn what a step observed into the next draft tree of each sequence that emitted tokens."""
import math
import time
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch
from torch import nn

from llmc.core.errors import LlmcError
from llmc.core.integers import cdiv
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.engine.draft_tree import ROOT, DraftTree
from llmc.runtime.engine.sequence import Sequence
from llmc.runtime.models.llama import LlamaForCausalLM
from llmc.runtime.speculative.draft_weights import int8_linear, with_int8_linears
from llmc.runtime.speculative.eagle import EagleDraft
from llmc.runtime.speculative.eagle3 import Eagle3Draft
from llmc.runtime.speculative.medusa import MedusaHeads
from llmc.runtime.speculative.shape import DEFAULT_SHAPES

TREE_TOP_K = 4  # tokens expanded per node, and paths kept per level, when drafting a tree (more for trees past 4 x depth)


@dataclass(slots=True)
class Observed:
    """What one step taught about a sequence: the target's features of tokens whose next token is now known."""

    seq: Sequence
    first_position: int  # position of the first feature
    features: torch.Tensor  # [n, hidden], consecutive positions
    next_token_ids: list[int]  # the token that followed each feature's position
    sampled: bool  # the step emitted tokens for it: it needs a new draft

    @classmethod
    def joined(cls, items: list["Observed"]) -> "Observed":
        """One sequence's observations of consecutive steps as one; a later one replaces the positions it observes
        again (recomputed after a preemption) and, past a gap, starts over."""
        first, features, token_ids = items[0].first_position, items[0].features[:0], []
        for item in items:
            kept = item.first_position - first
            if kept > len(features):
                first, features, token_ids, kept = item.first_position, features[:0], [], 0
            features = torch.cat([features[:kept], item.features])
            token_ids = token_ids[:kept] + item.next_token_ids[: len(item.features)]
        return cls(items[-1].seq, first, features, token_ids, items[-1].sampled)


class MedusaProposer:
    """Head k's guesses fill level k + 1 of the tree. The heads guess independently of each other, so a path's
    probability is the product of its heads' probabilities of its tokens: each level expands the top_k guesses of
    its head under every node of the level above and keeps the top_k most probable paths (Medusa's tree attention);
    the num_nodes most probable nodes of log-probability at least min_score are proposed. top_k 1 drafts a chain of each
    head's top-1 guess."""

    catch_up_seconds = 0.0  # the heads read the last feature only: a pause leaves nothing to catch up

    def __init__(self, heads: MedusaHeads, depth: int, num_nodes: int, top_k: int, min_score: float):
        self.heads = heads
        self.max_depth, self.num_nodes, self.top_k, self.min_score = depth, num_nodes, top_k, min_score

    def propose(self, observed: list[Observed], drafting: bool) -> dict:
        sampled = [item for item in observed if item.sampled]
        if not drafting or not sampled:
            return {}
        last = torch.stack([item.features[-1] for item in sampled])
        logits = self.heads(last, self.max_depth)
        top = logits.float().log_softmax(-1).topk(self.top_k, dim=-1)  # [depth, sequences, top_k]
        values, token_ids = top.values.cpu(), self.heads.vocab[top.indices].cpu()
        trees = {}
        for column, item in enumerate(sampled):
            tree, scores, frontier = DraftTree(), [], [ROOT]
            for depth in range(self.max_depth):
                guesses = values[depth, column].expand(len(frontier), -1), token_ids[depth, column].expand(len(frontier), -1)
                frontier = add_level(tree, scores, frontier, *guesses)
            trees[item.seq] = most_probable_nodes(tree, scores, self.num_nodes, self.min_score)
        return trees


@dataclass(slots=True)
class EagleCache:
    """The draft layer's keys and values over a sequence's (feature, next token) pairs, and its last prediction."""

    keys: torch.Tensor  # [1, pairs, kv_heads, head_dim]
    values: torch.Tensor
    next_position: int
    last_output: torch.Tensor | None = None  # the predicted feature after the last pair


class EagleProposer:
    """Feeds every (feature, next token) pair the target computes into the EAGLE layer, then drafts a tree from its
    last prediction. EAGLE predicts the target's next final feature, which the target's LM head rows of the draft
    vocabulary rank; EAGLE-3 reads the target's fused aux features and ranks tokens with its own normed LM head.
    Each level expands the top_k tokens of every node of the level above, keeps the top_k most
    probable paths (the product of the draft's own probabilities, EAGLE-2's confidence) and feeds their predicted
    features back in; the num_nodes most probable nodes of log-probability at least min_score are proposed, and no level
    is drafted below one where no path reaches min_score (EAGLE-2's dynamic tree: the draft's confidence tracks
    its acceptance, so an unsure draft costs neither drafting nor verification). top_k 1 drafts a chain."""

    def __init__(self, draft: EagleDraft | Eagle3Draft, model: LlamaForCausalLM, depth: int, num_nodes: int, top_k: int,
                 min_score: float):
        self.draft, self.model = draft, model
        self.vocab = draft.vocab.cpu()
        if isinstance(draft, Eagle3Draft):
            self.combine, self.guess = draft.combine, draft.logits
        else:
            identity = torch.eye(draft.shape.hidden_size, dtype=model.embed_tokens.dtype, device=model.embed_tokens.device)
            rows = model.compute_logits(identity)[:, draft.vocab].T  # the target's LM head over the draft vocabulary
            self.combine, self.guess = nn.Identity(), int8_linear(rows, None, model.embed_tokens.dtype, str(model.embed_tokens.device))
        self.max_depth, self.num_nodes, self.top_k, self.min_score = depth, num_nodes, top_k, min_score
        self.caches: WeakKeyDictionary[Sequence, EagleCache] = WeakKeyDictionary()
        self.pending: WeakKeyDictionary[Sequence, list[Observed]] = WeakKeyDictionary()
        self.catch_up_seconds = 0.0  # of the last proposal, spent taking in the pairs that waited

    def propose(self, observed: list[Observed], drafting: bool) -> dict:
        """While not drafting (under load, or when drafting does not pay) the pairs wait, at no cost, and go into the
        layer in one forward when drafting resumes: a draft from a context with holes would guess worse. That
        catch-up is timed apart: it is the pause's deferred work, not what drafting costs per step."""
        self.catch_up_seconds = 0.0
        if not drafting:
            for item in observed:
                self.pending.setdefault(item.seq, []).append(item)
            return {}
        trees = {}
        for item in observed:
            waiting = self.pending.pop(item.seq, None)
            if waiting:
                catching_up = time.perf_counter()
                self._commit(Observed.joined(waiting))
                self.catch_up_seconds += time.perf_counter() - catching_up
            cache = self._commit(item)
            if item.sampled and cache.last_output is not None:
                trees[item.seq] = self._draft(cache)
        return trees

    def _commit(self, item: Observed) -> EagleCache:
        like = item.features
        empty = torch.empty(1, 0, self.draft.num_kv_heads, self.draft.head_dim, dtype=like.dtype, device=like.device)
        cache = self.caches.setdefault(item.seq, EagleCache(empty, empty, item.first_position))
        skip = max(0, cache.next_position - item.first_position)  # recomputed after a preemption: already in
        features, token_ids = item.features[skip:], item.next_token_ids[skip : len(item.features)]
        if not len(features):
            return cache
        features = self.combine(features)
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
        columns: dict[int, int] = {}  # the key column of each node fed into the layer
        frontier, frontier_features = [ROOT], cache.last_output[None]
        for depth in range(1, self.max_depth + 1):
            top = self.guess(frontier_features).float().log_softmax(-1).cpu().topk(self.top_k, dim=-1)
            parents, level = frontier, add_level(tree, scores, frontier, top.values, self.vocab[top.indices])
            # a path below min_score has no descendant above it: only the confident nodes are worth expanding
            level = [node for node in level if scores[node] >= self.min_score]
            if depth == self.max_depth or not level:
                break
            parent_rows = [parents.index(tree.parents[node]) for node in level]
            columns |= {node: keys.shape[1] + row for row, node in enumerate(level)}
            visible = torch.zeros(len(level), keys.shape[1] + len(level), dtype=torch.bool)
            visible[:, : cache.keys.shape[1]] = True
            for row, node in enumerate(level):
                visible[row, [columns[ancestor] for ancestor in tree.path(node)]] = True
            embedded = self.model.embed_tokens[torch.tensor([tree.tokens[node] for node in level])]
            positions = torch.full((1, len(level)), cache.next_position + depth - 1)
            out, new_keys, new_values = self.draft(
                frontier_features[parent_rows][None], embedded[None], positions, visible.to(keys.device), (keys, values)
            )
            keys, values = torch.cat([keys, new_keys], 1), torch.cat([values, new_values], 1)
            frontier, frontier_features = level, out[0]
        return most_probable_nodes(tree, scores, self.num_nodes, self.min_score)


def add_level(tree: DraftTree, scores: list[float], frontier: list[int], logprobs: torch.Tensor, token_ids: torch.Tensor) -> list[int]:
    """Grow the tree by one level: logprobs and token_ids [len(frontier), top_k] are each frontier node's best guesses
    for the next token; of all (node, guess) pairs, the top_k most probable paths become the new level, whose nodes
    are returned. scores holds each node's path log-probability."""
    top_k = logprobs.shape[1]
    frontier_scores = torch.tensor([0.0 if node == ROOT else scores[node] for node in frontier])
    candidates = (frontier_scores[:, None] + logprobs).flatten()
    best = candidates.topk(min(top_k, len(candidates))).indices.tolist()
    token_ids = token_ids.flatten().tolist()
    first = len(tree)
    for index in best:
        tree.tokens.append(token_ids[index])
        tree.parents.append(frontier[index // top_k])
        scores.append(float(candidates[index]))
    return list(range(first, len(tree)))


def most_probable_nodes(tree: DraftTree, scores: list[float], num_nodes: int, min_score: float = -math.inf) -> DraftTree:
    """The num_nodes nodes of highest path log-probability, those of at least min_score, parents first; a path is
    never likelier than its parent, so the kept nodes form a tree."""
    depths = tree.depths
    confident = [node for node in range(len(tree)) if scores[node] >= min_score]
    kept = sorted(sorted(confident, key=lambda node: (-scores[node], depths[node]))[:num_nodes])
    renumbered = {old: new for new, old in enumerate(kept)} | {ROOT: ROOT}
    return DraftTree([tree.tokens[node] for node in kept], [renumbered[tree.parents[node]] for node in kept])


def build_proposer(draft_config: dict, heads: nn.Module, model: LlamaForCausalLM, config: EngineConfig):
    if draft_config["method"] not in DEFAULT_SHAPES:
        raise LlmcError(f"unknown draft method {draft_config['method']!r}")
    default = DEFAULT_SHAPES[draft_config["method"]]
    depth = config.num_speculative_tokens or default.depth
    if draft_config["method"] == "medusa":
        depth = min(depth or heads.num_heads, heads.num_heads)
    num_nodes = max(default.num_nodes if config.speculative_tree_nodes is None else config.speculative_tree_nodes, depth)
    min_confidence = default.min_confidence if config.speculative_min_confidence is None else config.speculative_min_confidence
    min_score = math.log(min_confidence) if min_confidence > 0 else -math.inf  # a path's log-probability
    top_k = max(TREE_TOP_K, cdiv(num_nodes, depth)) if num_nodes > depth else 1  # each level keeps top_k paths: enough to fill
    heads = with_int8_linears(heads, config.dtype, config.device).to(config.device, config.dtype)
    if draft_config["method"] == "medusa":
        return MedusaProposer(heads, depth, num_nodes, top_k, min_score)
    return EagleProposer(heads, model, depth, num_nodes, top_k, min_score)
