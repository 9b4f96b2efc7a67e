"""Whether drafting pays, measured while serving. Verifying drafts costs forward time that only accepted tokens
repay, and the break-even depends on the hardware, the batch and the draft's acceptance: so keep, for each batch size,
a moving average of the output rate (tokens per second) of decode steps with drafts and without, draft while that
wins at the batch size at hand, and now and then spend one decision the other way so that both rates stay current
as acceptance changes. Each probe that finds the same winner doubles the wait before the next (up to
`max_probe_every`): where drafting keeps losing, probing it would otherwise keep costing. Rates are never compared
across batch sizes: a batch of 8 outputs more tokens per second than a batch of 2 whatever the drafts do."""
from dataclasses import dataclass, field


@dataclass(slots=True)
class ProbeSchedule:
    """One batch size's current winner and when it is next checked."""

    winner: bool
    interval: int  # decisions between probes
    num_since_probe: int = 0


@dataclass
class DraftGovernor:
    probe_every: int = 16
    max_probe_every: int = 512
    smoothing: float = 0.25
    rates: dict[tuple[int, bool], float] = field(default_factory=dict)  # by (sequences in the step, drafted)
    schedules: dict[int, ProbeSchedule] = field(default_factory=dict)  # by sequences in the step

    def record(self, num_seqs: int, drafted: bool, num_tokens: int, seconds: float) -> None:
        rate = num_tokens / max(seconds, 1e-9)
        previous = self.rates.get((num_seqs, drafted))
        self.rates[num_seqs, drafted] = rate if previous is None else previous + self.smoothing * (rate - previous)

    def should_draft(self, num_seqs: int) -> bool:
        unmeasured = [drafted for drafted in (True, False) if (num_seqs, drafted) not in self.rates]
        if unmeasured:
            return unmeasured[0]
        winner = self.rates[num_seqs, True] >= self.rates[num_seqs, False]
        schedule = self.schedules.get(num_seqs)
        if schedule is None or schedule.winner != winner:
            schedule = self.schedules[num_seqs] = ProbeSchedule(winner, self.probe_every)
        schedule.num_since_probe += 1
        if schedule.num_since_probe < schedule.interval:
            return winner
        schedule.num_since_probe, schedule.interval = 0, min(2 * schedule.interval, self.max_probe_every)
        return not winner
