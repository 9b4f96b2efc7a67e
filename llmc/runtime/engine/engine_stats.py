"""The engine's counters, for /metrics: read in process, or sent by an engine process with each step; the
speculative decoder's among them."""
from dataclasses import dataclass, field


@dataclass
class SpeculativeStats:
    """Counters named like vLLM's spec-decode metrics; an accepted length counts the bonus token."""

    num_positions: int
    num_steps: int = 0  # a sequence's steps that emitted tokens, with a draft or without one
    num_drafts: int = 0  # verification steps that had at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    accepted_lengths: dict[int, int] = field(default_factory=dict)  # accepted length: how many drafts

    def __post_init__(self) -> None:
        self.accepted_per_position = self.accepted_per_position or [0] * self.num_positions

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_steps += 1
        if not num_draft_tokens:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        self.accepted_lengths[num_accepted + 1] = self.accepted_lengths.get(num_accepted + 1, 0) + 1

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens per target forward over every step, those an unsure draft left undrafted included."""
        return 1 + self.num_accepted_tokens / self.num_steps if self.num_steps else 1.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [accepted / self.num_drafts if self.num_drafts else 0.0 for accepted in self.accepted_per_position]


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
