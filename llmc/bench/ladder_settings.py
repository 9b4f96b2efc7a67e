"""The ladder's settings, apart from its machinery so that the CLI reads their defaults without importing it."""
from dataclasses import dataclass

from llmc.bench.goodput import SearchLimits, Slo


@dataclass(frozen=True)
class LadderSettings:
    num_prompts: int = 64  # requests per probed rate, at least
    probe_seconds: float = 30.0  # and at least as many as arrive in this long at the rate
    max_tokens: int = 128
    slo: Slo = Slo()
    limits: SearchLimits = SearchLimits()
    budget_s: float = 1800.0  # all rungs' load tests together
    hf_batch_size: int = 8  # the transformers rung's static batch
    quality_items: int = 32  # business items of each rung's quality comparison; 0: none
    seed: int = 0
