"""What an eval section needs before any model is loaded: the perplexity text, the business items and the lm-eval
task names, each read or resolved once, so a missing one stops the run before any work."""
from dataclasses import dataclass

from llmc.evals.business_set import BusinessItem, load_business_set
from llmc.evals.config import EvalConfig
from llmc.evals.perplexity import load_eval_text


@dataclass
class EvalInputs:
    text: str | None = None
    items: list[BusinessItem] | None = None
    tasks: tuple | None = None  # resolve_tasks' (task names, lm-eval TaskManager)


def load_perplexity_text(config: EvalConfig) -> str | None:
    return load_eval_text(config.perplexity.dataset) if config.perplexity else None


def load_business_items(config: EvalConfig) -> list[BusinessItem] | None:
    return load_business_set(config.business.dataset)[: config.business.limit] if config.business else None


def check_tasks(config: EvalConfig) -> tuple | None:
    if not config.tasks:
        return None
    from llmc.evals.lm_eval_model import resolve_tasks  # lm-eval is slow to import; only when asked

    return resolve_tasks(config.tasks.names, config.tasks.allow_code)


def load_eval_inputs(config: EvalConfig) -> EvalInputs:
    return EvalInputs(load_perplexity_text(config), load_business_items(config), check_tasks(config))
