"""The quality gate: every quantized target must hold every threshold against the baseline."""
from dataclasses import asdict, dataclass

from pydantic import Field

from llmc.core.errors import LlmcError
from llmc.core.schema import StrictModel


class GateConfig(StrictModel):
    """Thresholds every quantized target must hold against the baseline."""

    min_recovery: float | None = Field(None, gt=0)
    max_perplexity_increase: float | None = Field(None, ge=0)
    max_kl: float | None = Field(None, ge=0)
    min_agreement: float | None = Field(None, ge=0, le=1)
    # the draft's mean accepted length (accepted + 1 per verification) on its held-out prompts, drafting a chain of
    # GATE_CHAIN tokens on every step (draft.build.held_out_acceptance); with `llmc eval --speculative`, on its prompts
    min_accepted_length: float | None = Field(None, ge=1)


class GateFailed(LlmcError):
    exit_code = 3


def require_gate_passed(report: dict, failure: str = "gate failed") -> None:
    """GateFailed listing every failing threshold when the report's gate did not pass."""
    gate = report.get("gate")
    if gate is not None and not gate["passed"]:
        raise GateFailed(f"{failure}:\n  " + "\n  ".join(gate["failures"]))


@dataclass
class GateResult:
    thresholds: dict[str, float]
    passed: bool
    failures: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


def check_gate(report: dict, gate: GateConfig) -> GateResult:
    failures = [
        f"{label}: {failure}"
        for label, result in report["targets"].items()
        if label != report["baseline"]
        for failure in _failures(result["vs_baseline"], gate)
    ]
    return GateResult(gate.model_dump(exclude_none=True), not failures, failures)


def _failures(comparison: dict, gate: GateConfig) -> list[str]:
    found = []
    if gate.min_recovery is not None:
        recoveries = {"business recovery": comparison["recovery"]} if "recovery" in comparison else {}
        recoveries |= {f"{name} recovery": value for name, value in comparison.get("task_recovery", {}).items()}
        found += [_at_least(name, value, gate.min_recovery, "min_recovery") for name, value in recoveries.items()]
    if gate.min_agreement is not None:
        found.append(_at_least("agreement", comparison["agreement"], gate.min_agreement, "min_agreement"))
    if gate.max_perplexity_increase is not None:
        found.append(_at_most("perplexity increase", comparison["perplexity_increase"], gate.max_perplexity_increase,
                              "max_perplexity_increase"))
    if gate.max_kl is not None:
        found.append(_at_most("mean KL", comparison["kl"], gate.max_kl, "max_kl"))
    return [failure for failure in found if failure]


def _at_least(name: str, value: float | None, threshold: float, key: str) -> str | None:
    if value is None:
        return f"{name} is undefined (the baseline scores 0), {key} {threshold} cannot hold"
    return None if value >= threshold else f"{name} {value:.4f} < {key} {threshold} (short by {threshold - value:.4f})"


def _at_most(name: str, value: float, threshold: float, key: str) -> str | None:
    return None if value <= threshold else f"{name} {value:.4f} > {key} {threshold} (over by {value - threshold:.4f})"


def check_accepted_length(mean_accepted_length: float, gate: GateConfig, where: str) -> None:
    """GateFailed when the draft accepts less than gate.min_accepted_length."""
    threshold = gate.min_accepted_length
    if threshold is not None and mean_accepted_length < threshold:
        raise GateFailed(f"gate failed: {where}: mean accepted length {mean_accepted_length:.3f} < min_accepted_length {threshold} "
                         f"(short by {threshold - mean_accepted_length:.3f})")
