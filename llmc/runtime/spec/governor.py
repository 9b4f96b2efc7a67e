"""Whether drafting pays, measured while serving. Verifying drafts costs forward time that only accepted tokens
repay, and the break-even depends on the hardware, the batch and the draft's acceptance: so keep a moving average
of the output rate (tokens per second) of decode steps with drafts and without, draft while that wins, and spend one
step in `probe_every` the other way so that both rates stay current as load and acceptance change."""
from dataclasses import dataclass, field


@dataclass
class DraftGovernor:
    probe_every: int = 16
    smoothing: float = 0.25
    rates: dict[bool, float | None] = field(default_factory=lambda: {True: None, False: None})  # by drafted
    num_decisions: int = 0

    def record(self, drafted: bool, num_tokens: int, seconds: float) -> None:
        rate = num_tokens / max(seconds, 1e-9)
        previous = self.rates[drafted]
        self.rates[drafted] = rate if previous is None else previous + self.smoothing * (rate - previous)

    def should_draft(self) -> bool:
        self.num_decisions += 1
        unmeasured = [drafted for drafted, rate in self.rates.items() if rate is None]
        if unmeasured:
            return unmeasured[0]
        winner = self.rates[True] >= self.rates[False]
        return winner if self.num_decisions % self.probe_every else not winner
