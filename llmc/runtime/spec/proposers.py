"""Proposers turn what a step observed into the next draft tree of each sequence that emitted tokens."""
from dataclasses import dataclass

import torch
from torch import nn

from llmc.errors import LlmcError
from llmc.runtime.config import EngineConfig
from llmc.runtime.models.llama import LlamaForCausalLM
from llmc.runtime.sequence import Sequence
from llmc.runtime.spec.tree import DraftTree


@dataclass(slots=True)
class Observed:
    """What one step taught about a sequence: the target's features of tokens whose next token is now known."""

    seq: Sequence
    features: torch.Tensor  # [n, hidden]
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


def build_proposer(draft_config: dict, heads: nn.Module, model: LlamaForCausalLM, config: EngineConfig):
    if draft_config["method"] == "medusa":
        return MedusaProposer(heads, model, min(config.num_speculative_tokens or heads.num_heads, heads.num_heads))
    raise LlmcError(f"unknown draft method {draft_config['method']!r}")
