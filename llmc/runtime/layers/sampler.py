from dataclasses import dataclass

import torch

from llmc.runtime.sampling_params import SamplingParams


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # under the model's own distribution (before temperature, top-k, top-p)
    top_logprobs: dict[int, float] | None = None


def _filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = logits / params.temperature
    if params.top_k:
        kth_largest = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        outside = cumulative - sorted_logits.softmax(-1) >= params.top_p  # keeps the token that crosses top_p
        logits = logits.masked_fill(outside.scatter(0, order, outside), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[SampledToken]:
    """logits [num_seqs, vocab] -> one token per row: argmax when greedy, else drawn with the row's generator."""
    logits = logits.float()
    greedy_tokens = logits.argmax(-1).tolist()
    sampled = []
    for row, (row_params, generator) in enumerate(zip(params, generators)):
        if row_params.greedy:
            token_id = greedy_tokens[row]
        else:
            probs = _filtered_logits(logits[row], row_params).softmax(-1)
            token_id = int(torch.multinomial(probs, 1, generator=generator))
        token = SampledToken(token_id)
        if row_params.logprobs is not None:
            logprobs = logits[row].log_softmax(-1)
            token.logprob = float(logprobs[token_id])
            top = torch.topk(logprobs, row_params.logprobs) if row_params.logprobs else None
            token.top_logprobs = dict(zip(top.indices.tolist(), top.values.tolist())) if top is not None else {}
        sampled.append(token)
    return sampled
