"""The speculative step around the target's forward: verify the draft tree each sequence carried into this step (the
forward computed its nodes after the last token, each attending only to its ancestors), keep the accepted path plus
one token of the target's, move the path's K/V into place, and let the proposer draft the next tree."""
import time
from pathlib import Path

import torch

from llmc.core.errors import LlmcError
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.engine.draft_tree import DraftTree
from llmc.runtime.engine.engine_stats import SpeculativeStats
from llmc.runtime.engine.grammar import masked_tree_logits
from llmc.runtime.engine.sequence import Sequence
from llmc.runtime.layers.sampler import SampledToken, greedy_tokens, sampled_token, sampling_probs
from llmc.runtime.models.llama import aux_layer_ids
from llmc.runtime.speculative.acceptance import greedy_accept, rejection_sample
from llmc.runtime.speculative.governor import DraftGovernor
from llmc.runtime.speculative.proposers import Observed, build_proposer
from llmc.runtime.speculative.store import load_draft


class SpeculativeDecoder:
    def __init__(self, folder: Path, runner, config: EngineConfig):
        # as stored: build_proposer quantizes the weights it serves as int8 from them, then casts the rest
        self.draft_config, heads = load_draft(folder, torch.float32, "cpu")
        if self.draft_config["hidden_size"] != runner.hf_config.hidden_size:
            raise LlmcError(f"{folder} was trained for hidden size {self.draft_config['hidden_size']}, "
                            f"this model has {runner.hf_config.hidden_size}")
        # EAGLE-3 reads these layers' features
        runner.model.aux_layer_ids = aux_layer_ids(self.draft_config.get("aux_layer_ids", ()), runner.hf_config.num_hidden_layers,
                                                   f"{folder} reads layers")
        self.model = runner.model
        self.proposer = build_proposer(self.draft_config, heads, runner.model, config)
        self.num_tokens = self.proposer.max_depth
        self.max_num_seqs = config.speculative_max_num_seqs
        self.max_model_len = runner.max_model_len
        self.slots = runner.slots
        # [2, layers, slots, kv_heads, head_dim] as bytes: moving entries needs no float8 copy kernel
        self.kv_slots = runner.kv_cache.flatten(2, 3).view(torch.uint8)
        self.compute_logits = runner.model.compute_logits
        self.stats = SpeculativeStats(self.num_tokens)
        self.governor = DraftGovernor() if config.adaptive_speculation else None
        self.drafting_seconds = 0.0  # spent drafting the trees the next step verifies
        self.drafting = False  # whether the trees the next step verifies were drafted (empty when the draft was unsure)

    def step(self, seqs: list[Sequence], hidden: torch.Tensor, started: float) -> dict[Sequence, list[SampledToken]]:
        """hidden: the forward's rows, each sequence's scheduled chunk in order (prompt or last token, then nodes);
        started: when the step's forward began."""
        decode_only, drafted = all(seq.num_uncomputed_tokens == 1 for seq in seqs), self.drafting
        chunks, start = [], 0
        for seq in seqs:
            chunks.append((seq, start, start + seq.num_scheduled_tokens))
            start += seq.num_scheduled_tokens
        verified = [(seq, start, end, end - (seq.num_computed_tokens + seq.num_scheduled_tokens - len(seq)) - 1)
                    for seq, start, end in chunks if seq.num_computed_tokens + seq.num_scheduled_tokens >= len(seq)]
        rows = [row for _, _, end, root in verified for row in range(root, end)]
        logits = self.compute_logits(hidden[rows]) if rows else None  # one LM-head matmul for the whole batch
        features = hidden if self.model.aux_hidden is None else self.model.aux_hidden  # what the draft reads
        outputs, observed, offset = {}, [], 0
        for seq, start, end, root in verified:
            path, tokens = self._verify(seq, seq.draft.truncated(end - root - 1), logits[offset : offset + end - root])
            offset += end - root
            self._move_kv(seq, path)
            outputs[seq] = tokens
            kept = list(range(start, root + 1)) + [root + 1 + node for node in path]
            known = seq.token_ids[seq.num_computed_tokens + 1 :] + [token.token_id for token in tokens]
            observed.append(Observed(seq, seq.num_computed_tokens, features[kept], known, True))
        for seq, start, end in chunks:
            if seq not in outputs:  # a prefill chunk that does not reach the last token
                first = seq.num_computed_tokens + 1
                next_token_ids = seq.token_ids[first : first + end - start]
                observed.append(Observed(seq, seq.num_computed_tokens, features[start:end], next_token_ids, False))
        proposing = time.perf_counter()
        self.drafting = self._propose(observed, outputs)
        finished = time.perf_counter()
        # a step's rate pays for the drafts it verified, drafted at the end of the step before, not for the next ones;
        # nor for catching up after a pause, which drafting on every step would have spread over the paused ones
        seconds = (proposing if self.drafting else finished) - started + self.drafting_seconds
        self.drafting_seconds = finished - proposing - self.proposer.catch_up_seconds if self.drafting else 0.0
        if self.governor is not None and decode_only:
            self.governor.record(len(seqs), drafted, sum(map(len, outputs.values())), seconds)
        return outputs

    def _verify(self, seq: Sequence, tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], list[SampledToken]]:
        """logits: row 0 after the last token, row 1 + n after node n -> (accepted path, emitted tokens). Tokens are
        chosen from the rows masked by the sequence's grammar, if any; logprobs stay the model's."""
        params = seq.params
        choose_from = logits if seq.grammar is None else masked_tree_logits(logits, seq.grammar, tree)
        if params.greedy:
            targets = greedy_tokens(choose_from)
            path = greedy_accept(targets, tree)
            last = targets[path[-1] + 1 if path else 0]
        else:
            probs = torch.stack([sampling_probs(row, params) for row in choose_from]).cpu()
            path, last = rejection_sample(probs, tree, seq.generator)
        self.stats.record(len(tree), len(path))
        rows = [0] + [node + 1 for node in path]
        token_ids = [tree.tokens[node] for node in path] + [last]
        return path, [sampled_token(token_id, logits[row], params) for token_id, row in zip(token_ids, rows)]

    def _move_kv(self, seq: Sequence, path: list[int]) -> None:
        """Node n was computed at cache position len(seq) + n; the accepted path's k-th node belongs at len(seq) + k."""
        moves = [(len(seq) + node, len(seq) + depth) for depth, node in enumerate(path) if node != depth]
        if moves:
            sources, targets = zip(*moves)
            self.kv_slots[:, :, self.slots(seq, list(targets))] = self.kv_slots[:, :, self.slots(seq, list(sources))]

    def _propose(self, observed: list[Observed], outputs: dict[Sequence, list[SampledToken]]) -> bool:
        """Gives each sampled sequence its next draft tree; whether this step drafted."""
        # under load the batch already fills the machine: drafts would only add work
        drafting = len(observed) <= self.max_num_seqs and (self.governor is None or self.governor.should_draft(len(observed)))
        trees = self.proposer.propose(observed, drafting)
        for item in observed:
            seq = item.seq
            if not item.sampled:
                continue
            num_new = len(outputs[seq])
            tree = trees.get(seq, DraftTree())
            max_depth = min(self.num_tokens, seq.params.max_tokens - seq.num_output_tokens - num_new - 1)
            max_nodes = max(0, self.max_model_len - len(seq) - num_new)
            seq.draft = tree.truncated(min(max_nodes, sum(depth <= max_depth for depth in tree.depths)))
        return drafting
