"""The speculative step around the target's forward: verify the drafts each sequence carried into this step (the
forward computed them after its last token, causally, so it is a chain mask over the paged cache), keep the
accepted ones plus one token of the target's, and propose the next drafts from the last kept hidden state."""
from pathlib import Path

import torch
import torch.nn.functional as F

from llmc.draft.store import load_draft
from llmc.errors import LlmcError
from llmc.runtime.config import EngineConfig
from llmc.runtime.layers.sampler import SampledToken, sampled_token, sampling_probs
from llmc.runtime.models.llama import LlamaForCausalLM
from llmc.runtime.sequence import Sequence
from llmc.runtime.spec.acceptance import greedy_accept, rejection_sample
from llmc.runtime.spec.stats import SpecStats


class SpeculativeDecoder:
    def __init__(self, folder: Path, model: LlamaForCausalLM, config: EngineConfig, hidden_size: int, max_model_len: int):
        self.draft_config, self.heads = load_draft(folder, config.dtype, config.device)
        if self.draft_config["hidden_size"] != hidden_size:
            raise LlmcError(f"{folder} was trained for hidden size {self.draft_config['hidden_size']}, this model has {hidden_size}")
        self.num_tokens = min(config.num_speculative_tokens or self.heads.num_heads, self.heads.num_heads)
        self.max_num_seqs = config.speculative_max_num_seqs
        self.max_model_len = max_model_len
        self.compute_logits = model.compute_logits
        self.stats = SpecStats(self.num_tokens)

    def accept(self, seqs: list[Sequence], hidden: torch.Tensor, logits: torch.Tensor, num_rows: list[int]) -> dict[Sequence, list[SampledToken]]:
        """Rows of hidden/logits: for each sequence its last token then its num_rows - 1 scheduled drafts."""
        outputs, kept_rows, start = {}, [], 0
        for seq, count in zip(seqs, num_rows):
            rows, drafts, params = logits[start : start + count], seq.draft_token_ids[: count - 1], seq.params
            if params.greedy:
                targets = rows.argmax(-1).tolist()
                token_ids = targets[: greedy_accept(targets, drafts) + 1]
            else:
                draft_probs = F.one_hot(torch.tensor(drafts, dtype=torch.long), rows.shape[-1]).float()  # drafts are top-1 guesses
                probs = torch.stack([sampling_probs(row, params) for row in rows]).cpu()
                token_ids = rejection_sample(probs, drafts, draft_probs, seq.generator)
            self.stats.record(len(drafts), len(token_ids) - 1)
            outputs[seq] = [sampled_token(token_id, rows[index], params) for index, token_id in enumerate(token_ids)]
            kept_rows.append(start + len(token_ids) - 1)
            start += count
        self._propose(seqs, hidden[kept_rows], outputs)
        return outputs

    def _propose(self, seqs: list[Sequence], hidden: torch.Tensor, outputs: dict[Sequence, list[SampledToken]]) -> None:
        if len(seqs) > self.max_num_seqs:  # under load the batch already fills the machine: drafts would only add work
            for seq in seqs:
                seq.draft_token_ids = []
            return
        guesses = self.compute_logits(self.heads(hidden)[: self.num_tokens].flatten(0, 1)).argmax(-1).view(self.num_tokens, -1)
        for column, seq in enumerate(seqs):
            num_new = len(outputs[seq])
            remaining = seq.params.max_tokens - seq.num_output_tokens - num_new
            count = max(0, min(self.num_tokens, remaining - 1, self.max_model_len - len(seq) - num_new))
            seq.draft_token_ids = guesses[:count, column].tolist()
