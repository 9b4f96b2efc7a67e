"""A snapshot of the engine's counters, for /metrics: read in process, or sent by an engine process with each step."""
from dataclasses import dataclass

from llmc.runtime.speculative.stats import SpeculativeStats


@dataclass(slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_used_blocks: int = 0
    num_blocks: int = 1
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    num_finished: dict[str, int] | None = None  # by reason: stop, length, abort
    speculative: SpeculativeStats | None = None  # None: the engine decodes without drafts
