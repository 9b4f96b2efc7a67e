"""Whether drafting pays, measured while serving. Verifying drafts costs forward time that only accepted tokens
repay, and the break-even depends on the hardware, the batch and the draft's acceptance: so keep, for each batch size,
a moving average of the output rate (tokens per second) of decode steps with drafts and without, draft while that
wins at the batch size at hand, and spend one decision in `probe_every` the other way so that both rates stay current
as acceptance changes. Rates are never compared across batch sizes: a batch of 8 outputs more tokens per second than a
batch of 2 whatever the drafts do."""
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class DraftGovernor:
    probe_every: int = 16
    smoothing: float = 0.25
    rates: dict[tuple[int, bool], float] = field(default_factory=dict)  # by (sequences in the step, drafted)
    num_decisions: Counter = field(default_factory=Counter)  # by sequences in the step

    def record(self, num_seqs: int, drafted: bool, num_tokens: int, seconds: float) -> None:
        rate = num_tokens / max(seconds, 1e-9)
        previous = self.rates.get((num_seqs, drafted))
        self.rates[num_seqs, drafted] = rate if previous is None else previous + self.smoothing * (rate - previous)

    def should_draft(self, num_seqs: int) -> bool:
        self.num_decisions[num_seqs] += 1
        unmeasured = [drafted for drafted in (True, False) if (num_seqs, drafted) not in self.rates]
        if unmeasured:
            return unmeasured[0]
        winner = self.rates[num_seqs, True] >= self.rates[num_seqs, False]
        return winner if self.num_decisions[num_seqs] % self.probe_every else not winner
