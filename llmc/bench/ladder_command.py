"""`llmc bench --ladder MODEL`: the inputs resolved first (the CLI then writes the recipe's rungs, pipeline/
ladder_recipes.py), every rung run within its share of the budget with a progress bar, then each rung's quality, the
table, JSON and PNG."""
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from llmc.bench.ladder import RungArtifacts, RungContext, RungResult, plan_rungs, run_rung, rung_quality
from llmc.bench.ladder_report import ladder_png, ladder_table, ratio_to_baseline
from llmc.bench.ladder_settings import LadderSettings
from llmc.core.errors import LlmcError
from llmc.core.prompts import chat_workload, prompt_rows

DEFAULT_WORKLOAD = Path("calib_data/business/customer_service.jsonl")
OUTPUTS = ("ladder.json", "ladder.png")


@dataclass(frozen=True)
class LadderInputs:
    model: str
    dataset: Path
    out: Path
    vllm: str = "auto"  # auto, off, or its venv or executable
    json_path: Path | None = None
    overwrite: bool = False


def check_inputs(inputs: LadderInputs, settings: LadderSettings, given: RungArtifacts) -> None:
    """What the ladder reads, before any work (the CLI checks the recipe): the workload, the business set, the rung
    artifacts given, vLLM, and whether earlier results would be replaced."""
    for name, path in vars(given).items():
        if path is not None and not Path(path).is_dir():
            raise LlmcError(f"--{name.replace('_', '-')}: {path} is not a folder")
    prompt_rows(inputs.dataset)
    if settings.quality_items:
        from llmc.evals.business_set import load_business_set

        try:
            load_business_set(inputs.dataset)
        except LlmcError as error:
            raise LlmcError(f"--dataset {inputs.dataset}: each rung's quality is measured on it as a business set "
                            f"({error}); give a business set or --quality-items 0") from None
    if inputs.vllm not in ("auto", "off"):
        from llmc.evals.vllm_speculative import vllm_executable

        vllm_executable(inputs.vllm)
    kept = [inputs.out / name for name in OUTPUTS if (inputs.out / name).exists()]
    if kept and not inputs.overwrite:
        raise LlmcError(f"{kept[0]} exists (an earlier ladder): pass --overwrite to replace it (the artifacts under "
                        f"{inputs.out / 'artifacts'} are reused either way), or choose another --out")


def found_vllm(choice: str, console: Console) -> str | None:
    """--vllm: auto finds it as `llmc serve --engine vllm` does and leaves vLLM's rungs out where it is not installed."""
    from llmc.external.vllm_server import find_vllm

    if choice == "off":
        return None
    if choice != "auto":
        return choice
    try:
        return find_vllm(None)
    except LlmcError as error:
        console.print(f"vLLM's rungs left out: {error}")
        return None


def run_ladder(inputs: LadderInputs, artifacts: RungArtifacts, settings: LadderSettings, context: RungContext,
               console: Console) -> list[RungResult]:
    """artifacts: the rungs' artifacts, checked by check_inputs (or written by the recipe's quantization)."""
    from transformers import AutoTokenizer

    from llmc.checkpoints.spec import resolve_model

    inputs.out.mkdir(parents=True, exist_ok=True)
    (inputs.out / "logs").mkdir(exist_ok=True)
    vllm = found_vllm(inputs.vllm, console)
    context = replace(context, log_folder=inputs.out / "logs", vllm=vllm)
    prompts = chat_workload(inputs.dataset, settings.num_prompts, AutoTokenizer.from_pretrained(resolve_model(inputs.model)))
    rungs = plan_rungs(inputs.model, artifacts, vllm)
    results: list[RungResult] = []
    deadline = time.monotonic() + settings.budget_s
    columns = (TextColumn("{task.description:>16}"), BarColumn(), TextColumn("{task.completed}/{task.total} probes"),
               TimeElapsedColumn(), TextColumn("{task.fields[last]}"))
    with Progress(*columns, console=console) as progress:
        tasks = {rung.name: progress.add_task(rung.name, total=settings.limits.max_probes, last="") for rung in rungs}
        for index, rung in enumerate(rungs):
            waiting = sum(1 for later in rungs[index:] if not later.missing)
            share = max(0.0, deadline - time.monotonic()) / max(1, waiting) if not rung.missing else 0.0
            progress.update(tasks[rung.name], last=f"budget {share:.0f} s")

            def on_probe(text: str, task=tasks[rung.name]) -> None:
                progress.update(task, advance=1, last=text)
                progress.console.print(text)  # a line per probe, kept in logs where no bar is drawn

            results.append(run_rung(rung, prompts, settings, share, context, on_probe))
            write_record(inputs, settings, results)  # what is finished is kept, whatever stops the ladder later
            outcome = results[-1].error or f"goodput {results[-1].goodput:.3g} req/s in {results[-1].seconds:.0f} s"
            progress.update(tasks[rung.name], completed=settings.limits.max_probes, last=outcome)
    if settings.quality_items:
        console.print(f"quality: business set {inputs.dataset}, first {settings.quality_items} items, against {inputs.model}")
        try:
            measured = rung_quality(rungs, inputs.model, inputs.dataset, settings.quality_items)
        except Exception as error:  # noqa: BLE001 - the rungs' results are kept and written without it
            console.print(f"[red]quality not measured: {type(error).__name__}: {error}[/]")
            measured = {}
        for name, quality in measured.items():
            next(result for result in results if result.rung.name == name).quality = quality
    write_outputs(inputs, settings, results, console)
    return results


def slo_text(settings: LadderSettings) -> str:
    return f"TTFT p90 <= {settings.slo.ttft_p90_ms:g} ms, TPOT p90 <= {settings.slo.tpot_p90_ms:g} ms"


def write_record(inputs: LadderInputs, settings: LadderSettings, results: list[RungResult]) -> str:
    """OUT/ladder.json, staged and renamed: the rungs measured so far."""
    record = {"model": inputs.model, "workload": str(inputs.dataset), "slo": slo_text(settings), "settings": asdict(settings),
              "rungs": [result.record() | dict(zip(("x_baseline", "x_baseline_is_lower_bound"), ratio_to_baseline(result, results[0])))
                        for result in results]}
    text = json.dumps(record, indent=2, default=str)
    staged = inputs.out / ".ladder.json.partial"
    staged.write_text(text)
    os.replace(staged, inputs.out / "ladder.json")
    return text


def write_outputs(inputs: LadderInputs, settings: LadderSettings, results: list[RungResult], console: Console) -> None:
    table = ladder_table(results, slo_text(settings))
    # a log or pipe has no width of its own: wide enough that the figures are not cut
    console.print(table, width=None if console.is_terminal else 220)
    text = write_record(inputs, settings, results)
    staged_png = inputs.out / ".ladder.partial.png"
    ladder_png(results, staged_png)
    os.replace(staged_png, inputs.out / "ladder.png")
    if inputs.json_path is not None:
        inputs.json_path.write_text(text)
    console.print(f"wrote {inputs.out / 'ladder.json'} and {inputs.out / 'ladder.png'}")
