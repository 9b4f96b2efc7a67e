"""Side by side: every configured eval on every target, the first target the baseline the others are
compared with. The report is a plain dict (report.json), the same for `llmc eval` and `llmc quantize`."""
from dataclasses import dataclass

import torch

from llmc.core.errors import LlmcError
from llmc.evals.business import BusinessResult, compare_business, recovery, run_business
from llmc.evals.business_set import BusinessItem
from llmc.evals.config import EvalConfig
from llmc.evals.divergence import mean_kl
from llmc.evals.gate import check_gate
from llmc.evals.generation import make_generator
from llmc.evals.inputs import EvalInputs, load_eval_inputs
from llmc.evals.loading import LoadedModel, load_model
from llmc.evals.perplexity import perplexity


@dataclass
class EvalTarget:
    label: str
    spec: str


@dataclass
class Measured:
    loaded: LoadedModel
    report: dict
    business: BusinessResult | None


def evaluate_specs(specs: list[str], config: EvalConfig, inputs: EvalInputs | None = None, device: torch.device | str = "cpu") -> dict:
    """evaluate_side_by_side over model specs or artifact folders, each labelled as given (a repeat gets #N)."""
    if config.gate is not None and len(specs) < 2:
        raise LlmcError("--gate compares targets with the first one: give at least two targets")
    labels = [spec if spec not in specs[:index] else f"{spec}#{index + 1}" for index, spec in enumerate(specs)]
    return evaluate_side_by_side([EvalTarget(label, spec) for label, spec in zip(labels, specs)], config, inputs, device)


def evaluate_side_by_side(targets: list[EvalTarget], config: EvalConfig, inputs: EvalInputs | None = None,
                          device: torch.device | str = "cpu") -> dict:
    """inputs: load_eval_inputs(config), when the caller resolved them already. Every target is evaluated by
    transformers on device, on the artifact's dequantized weights (with its activation and KV-cache quantization
    emulated), so the numbers are the artifact's own wherever they are measured."""
    inputs = inputs or load_eval_inputs(config)
    report = {"baseline": targets[0].label, "settings": config.model_dump(mode="json", exclude={"gate"}), "targets": {}}
    base = None
    for target in targets:
        measured = measure(target, config, inputs, device)
        if base is None:
            base = measured
        else:
            measured.report["vs_baseline"] = compare(base, measured, inputs.items, target.label)
        report["targets"][target.label] = measured.report
    if config.gate is not None:
        report["gate"] = check_gate(report, config.gate).to_dict()
    return report


def measure(target: EvalTarget, config: EvalConfig, inputs: EvalInputs, device: torch.device) -> Measured:
    loaded = load_model(target.spec, device=device)
    report: dict = {"target": target.spec}
    if config.perplexity:
        settings = config.perplexity
        report["perplexity"] = perplexity(loaded.model, loaded.tokenizer, inputs.text, settings.dataset, settings.seq_len,
                                          settings.max_windows, label=f"perplexity {target.label}").to_dict()
    items = inputs.items
    business = run_business(make_generator(loaded), items, f"business {target.label}") if items else None
    if business:
        report["business"] = business.to_dict()
    if config.tasks:
        from llmc.evals.lm_eval_model import run_lm_eval  # lm-eval is slow to import; only when asked

        report["lm_eval"] = run_lm_eval(loaded, config.tasks.names, config.tasks.limit, inputs.tasks)
    return Measured(loaded, report, business)


def compare(base: Measured, other: Measured, items: list[BusinessItem] | None, label: str) -> dict:
    comparison = {}
    if "perplexity" in other.report:
        comparison["perplexity_increase"] = other.report["perplexity"]["perplexity"] / base.report["perplexity"]["perplexity"] - 1
    if items:
        comparison |= compare_business(base.business, other.business)
        comparison["kl"] = mean_kl(base.loaded.model, other.loaded.model, base.loaded.tokenizer, items, f"KL {label}")
    if "lm_eval" in other.report:
        comparison["task_recovery"] = {
            f"{task}/{metric}": recovery(result["value"], base.report["lm_eval"][task][metric]["value"])
            for task, metrics in other.report["lm_eval"].items()
            for metric, result in metrics.items()
            if result["higher_is_better"]
        }
    return comparison
