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
        outside[0] = False  # and the likeliest always: a top_p under float32's smallest value compares as 0
        logits = logits.masked_fill(outside.scatter(0, order, outside), float("-inf"))
    return logits


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, the first index on ties. Through max: torch's CPU argmax is not vectorised for bfloat16
    and takes 4-5x longer (2 ms for a verification step's 8 rows of SmolLM2's 49,152 logits)."""
    return logits.max(-1).indices.tolist()


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a row's token is drawn from, after temperature, top-k and top-p."""
    return _filtered_logits(logits.float(), params).softmax(-1)


def token_logprobs(token_id: int, logprobs: torch.Tensor, num_top: int) -> SampledToken:
    """token_id with its logprob and the num_top most likely tokens', from a row of log-softmaxed logits."""
    top = torch.topk(logprobs, num_top)
    return SampledToken(token_id, float(logprobs[token_id]), dict(zip(top.indices.tolist(), top.values.tolist())))


def sampled_token(token_id: int, logits: torch.Tensor, params: SamplingParams) -> SampledToken:
    """The token with the logprobs the request asked for, from its row of logits."""
    if params.logprobs is None:
        return SampledToken(token_id)
    return token_logprobs(token_id, logits.float().log_softmax(-1), params.logprobs)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           constrained: torch.Tensor | None = None) -> list[SampledToken]:
    """logits [num_seqs, vocab] -> one token per row: argmax when greedy, else drawn with the row's generator.
    constrained: the logits with each row masked to what its grammar allows, to choose from; logprobs stay the model's."""
    choose_from = logits if constrained is None else constrained
    greedy = greedy_tokens(choose_from)
    sampled = []
    for row, (row_params, generator) in enumerate(zip(params, generators)):
        if row_params.greedy:
            token_id = greedy[row]
        else:
            probs = sampling_probs(choose_from[row], row_params)
            if generator is not None:  # seeded generators live on the CPU: the same seed draws the same tokens on any device
                probs = probs.to(generator.device)
            token_id = int(torch.multinomial(probs, 1, generator=generator))
        sampled.append(sampled_token(token_id, logits[row], row_params))
    return sampled
