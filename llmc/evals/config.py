"""What `llmc eval` and a recipe's `eval` section measure: perplexity, a business set, lm-eval tasks, and the gate
over them."""
from pydantic import Field, model_validator

from llmc.core.errors import LlmcError
from llmc.core.schema import StrictModel
from llmc.core.validation import validated
from llmc.evals.gate import GateConfig


class PerplexityEval(StrictModel):
    dataset: str
    seq_len: int = Field(1024, gt=0)
    max_windows: int | None = Field(40, gt=0)


class BusinessEval(StrictModel):
    dataset: str
    limit: int | None = Field(None, gt=0)


class LmEvalTasks(StrictModel):
    names: list[str] = Field(min_length=1)
    limit: float | None = Field(None, gt=0)
    allow_code: bool = False  # run the Python a task YAML's `!function` tags name (llmc's bundled tasks always may)


class EvalConfig(StrictModel):
    perplexity: PerplexityEval | None = None
    business: BusinessEval | None = None
    tasks: LmEvalTasks | None = None
    gate: GateConfig | None = None
    baseline: bool = True

    @model_validator(mode="after")
    def _gate_has_its_metrics(self) -> "EvalConfig":
        gate = self.gate
        if gate is None:
            return self
        requirements = {  # the thresholds against the baseline (min_accepted_length measures the draft alone)
            "min_recovery": (self.business or self.tasks, "eval.business or eval.tasks"),
            "max_perplexity_increase": (self.perplexity, "eval.perplexity"),
            "max_kl": (self.business, "eval.business"),
            "min_agreement": (self.business, "eval.business"),
        }
        if not self.baseline and any(getattr(gate, threshold) is not None for threshold in requirements):
            raise ValueError("gate: compares against the baseline, so it needs baseline: true")
        for threshold, (measured, source) in requirements.items():
            if getattr(gate, threshold) is not None and not measured:
                raise ValueError(f"gate.{threshold}: needs {source} to be measured")
        return self


def eval_config(data: dict, source: str) -> EvalConfig:
    """An eval section built from command-line options, validated like a recipe's."""
    return validated(EvalConfig, {key: value for key, value in data.items() if value is not None}, source)


def options_eval_config(perplexity: str | None, seq_len: int, max_windows: int, business: str | None, tasks: str | None,
                        limit: int | None, gate: list[str], allow_task_code: bool = False) -> EvalConfig:
    """The eval section `llmc eval`'s options describe (`gate` as KEY=VALUE thresholds)."""
    if not (perplexity or business or tasks):
        raise LlmcError("nothing to evaluate: pass --perplexity FILE|wikitext2, --business FILE, --tasks NAMES or --speculative")
    if allow_task_code and not tasks:
        raise LlmcError("--allow-task-code lets a task YAML's `!function` tags run: it goes with --tasks")
    config = eval_config({
        "perplexity": {"dataset": perplexity, "seq_len": seq_len, "max_windows": max_windows} if perplexity else None,
        "business": {"dataset": business, "limit": limit} if business else None,
        "tasks": {"names": [name.strip() for name in tasks.split(",") if name.strip()], "limit": limit,
                  "allow_code": allow_task_code} if tasks else None,
        "gate": gate_thresholds(gate) or None,
    }, source="llmc eval options")
    if config.gate is not None and config.gate.min_accepted_length is not None:
        raise LlmcError("--gate min_accepted_length: measures a draft, so it goes with --speculative")
    return config


def gate_thresholds(assignments: list[str]) -> dict[str, str]:
    """--gate KEY=VALUE options as a gate section (validated by its caller)."""
    return dict(_threshold(item) for item in assignments)


def _threshold(assignment: str) -> tuple[str, str]:
    key, separator, value = assignment.partition("=")
    if not separator:
        raise LlmcError(f"--gate expects KEY=VALUE (e.g. min_recovery=0.95), got {assignment!r}")
    return key.strip(), value.strip()
