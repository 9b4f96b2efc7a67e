"""Whether drafting pays, measured while serving. Verifying drafts costs forward time that only accepted tokens
repay, and the break-even depends on the hardware, the batch and the draft's acceptance. A decode step's output
rate is (sequences x tokens each sequence gains) / step time, and its two factors are measured apart: the step time
of drafted and of plain steps, for each batch size (a batch of 8 takes longer than a batch of 2 whatever the
drafts do), and the tokens a sequence gains per drafted step, pooled over every batch size (how far a draft is
accepted depends on the draft and the text, not on the sequences beside it; a plain step gains one). Step times
vary little from step to step while acceptance varies a lot, so pooling it makes every batch size's decision rest
on all the drafts seen. The governor drafts while that rate wins at the batch size at hand, and now and then
spends one decision the other way so that both stay current; each probe that finds the same winner doubles the
wait before the next (up to `max_probe_every`): where drafting keeps losing, probing it would otherwise keep costing."""
from dataclasses import dataclass, field


@dataclass(slots=True)
class ProbeSchedule:
    """One batch size's current winner and when it is next checked."""

    winner: bool
    interval: int  # decisions between probes
    num_since_probe: int = 0


def moving_average(previous: float | None, value: float, smoothing: float) -> float:
    return value if previous is None else previous + smoothing * (value - previous)


@dataclass
class DraftGovernor:
    probe_every: int = 16
    max_probe_every: int = 512
    smoothing: float = 0.25  # of step times
    acceptance_smoothing: float = 0.1  # of tokens per drafted step: it varies more, and every batch size feeds it
    step_seconds: dict[tuple[int, bool], float] = field(default_factory=dict)  # by (sequences in the step, drafted)
    tokens_per_drafted_step: float | None = None  # a sequence's, emitted token included
    schedules: dict[int, ProbeSchedule] = field(default_factory=dict)  # by sequences in the step

    def record(self, num_seqs: int, drafted: bool, num_tokens: int, seconds: float) -> None:
        key = (num_seqs, drafted)
        self.step_seconds[key] = moving_average(self.step_seconds.get(key), seconds, self.smoothing)
        if drafted:
            self.tokens_per_drafted_step = moving_average(self.tokens_per_drafted_step, num_tokens / num_seqs, self.acceptance_smoothing)

    def rate(self, num_seqs: int, drafted: bool) -> float:
        """Expected tokens per second of a decode step of num_seqs sequences, both factors measured."""
        tokens = self.tokens_per_drafted_step if drafted else 1.0
        return num_seqs * tokens / max(self.step_seconds[num_seqs, drafted], 1e-9)

    def should_draft(self, num_seqs: int) -> bool:
        unmeasured = [drafted for drafted in (True, False) if (num_seqs, drafted) not in self.step_seconds]
        if unmeasured:
            return unmeasured[0]
        winner = self.rate(num_seqs, True) >= self.rate(num_seqs, False)
        schedule = self.schedules.get(num_seqs)
        if schedule is None or schedule.winner != winner:
            schedule = self.schedules[num_seqs] = ProbeSchedule(winner, self.probe_every)
        schedule.num_since_probe += 1
        if schedule.num_since_probe < schedule.interval:
            return winner
        schedule.num_since_probe, schedule.interval = 0, min(2 * schedule.interval, self.max_probe_every)
        return not winner
