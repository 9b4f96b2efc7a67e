"""Goodput at an SLO: the highest Poisson request rate at which p90 TTFT and p90 TPOT stay within their limits, found by
a bounded search (double until a rate fails, then bisect geometrically between the last pass and the first failure)."""
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Slo:
    ttft_p90_ms: float = 2000.0
    tpot_p90_ms: float = 100.0

    def misses(self, summary: dict) -> list[str]:
        """What a probe's summary (load.summarize's) breaks: empty when it meets the SLO."""
        ttft, tpot = summary["ttft"].get("p90_ms", math.inf), summary["tpot"].get("p90_ms", math.inf)
        missed = [f"TTFT p90 {ttft:.0f} ms > {self.ttft_p90_ms:g}"] if ttft > self.ttft_p90_ms else []
        return missed + ([f"TPOT p90 {tpot:.1f} ms > {self.tpot_p90_ms:g}"] if tpot > self.tpot_p90_ms else [])


@dataclass(frozen=True)
class SearchLimits:
    max_probes: int = 6
    resolution: float = 1.25  # stop bisecting once the failing rate is within this factor of the passing one
    min_rate: float = 1e-3  # requests/s: below this a rate counts as none


@dataclass
class Probe:
    rate: float
    summary: dict
    misses: list[str]


@dataclass
class Goodput:
    rate: float  # requests/s; 0.0 when no probed rate met the SLO
    at_rate: dict | None  # the summary of the probe at that rate
    probes: list[Probe] = field(default_factory=list)
    stopped_by: str = "resolution"  # resolution, probes, budget or min_rate


def find_goodput(probe: Callable[[float], dict], slo: Slo, start_rate: float, limits: SearchLimits,
                 deadline: float) -> Goodput:
    """probe(rate) runs the workload at that Poisson rate and returns its summary. At least one probe runs; another
    starts only before `deadline` (time.monotonic())."""
    passed: Probe | None = None
    failed: Probe | None = None
    result = Goodput(0.0, None)
    rate = start_rate
    while True:
        summary = probe(rate)
        current = Probe(rate, summary, slo.misses(summary))
        result.probes.append(current)
        if current.misses:
            failed = current if failed is None or rate < failed.rate else failed
        else:
            passed = current if passed is None or rate > passed.rate else passed
        if passed is not None and failed is not None and failed.rate / passed.rate <= limits.resolution:
            break
        if len(result.probes) >= limits.max_probes:
            result.stopped_by = "probes"
            break
        if time.monotonic() >= deadline:
            result.stopped_by = "budget"
            break
        if failed is None:
            rate = passed.rate * 2
        elif passed is None:
            rate = failed.rate / 2
            if rate < limits.min_rate:
                result.stopped_by = "min_rate"
                break
        else:
            rate = math.sqrt(passed.rate * failed.rate)
    if passed is not None:
        result.rate, result.at_rate = passed.rate, passed.summary
    return result
