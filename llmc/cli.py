import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from llmc.errors import LlmcError

console = Console()


@click.group()
@click.version_option(package_name="llmc-toolchain")
def cli() -> None:
    """llmc: quantize, evaluate and serve LLMs."""


@cli.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--output", "-o", help="Artifact folder (overrides the recipe's `output`).")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a recipe field.")
@click.option("--overwrite", is_flag=True, help="Replace an existing artifact folder.")
def quantize(recipe: Path, output: str | None, overrides: tuple[str, ...], overwrite: bool) -> None:
    """Run RECIPE (YAML) and write a compressed-tensors artifact."""
    from llmc.pipeline import run_quantize
    from llmc.recipe import load_recipe

    loaded = load_recipe(recipe, list(overrides), output)
    artifact = run_quantize(loaded, overwrite)
    console.print(f"[green]wrote[/] {artifact}")


@cli.command(name="eval")
@click.argument("targets", nargs=-1, required=True)
@click.option("--perplexity", "perplexity_data", metavar="FILE|NAME", help="Text file, or `wikitext2` (hub).")
@click.option("--seq-len", default=1024, show_default=True, type=click.IntRange(min=2))
@click.option("--max-windows", default=40, show_default=True, type=click.IntRange(min=1))
@click.option("--business", metavar="FILE", help="Business eval set (JSONL).")
@click.option("--tasks", metavar="NAMES", help="lm-eval tasks, comma-separated: names or task YAML files.")
@click.option("--limit", type=click.IntRange(min=1), help="Only the first N business items and task documents.")
@click.option("--gate", "gate", multiple=True, metavar="KEY=VALUE",
              help="Threshold, e.g. min_recovery=0.95, max_perplexity_increase=0.05, max_kl=0.1, min_agreement=0.8.")
@click.option("--out", type=click.Path(path_type=Path), help="Write report.json, report.md and PNG charts here.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def evaluate(targets: tuple[str, ...], perplexity_data: str | None, seq_len: int, max_windows: int, business: str | None,
             tasks: str | None, limit: int | None, gate: tuple[str, ...], out: Path | None, as_json: bool) -> None:
    """Evaluate TARGETS (model specs or artifacts) side by side; the first is the baseline."""
    from llmc.evals.gate import GateFailed
    from llmc.evals.report import SUMMARY_COLUMNS, summary_rows, write_report
    from llmc.evals.suite import EvalTarget, evaluate_side_by_side
    from llmc.recipe import eval_config

    if not (perplexity_data or business or tasks):
        raise LlmcError("nothing to evaluate: pass --perplexity FILE|wikitext2, --business FILE or --tasks NAMES")
    if gate and len(targets) < 2:
        raise LlmcError("--gate compares targets with the first one: give at least two targets")
    config = eval_config({
        "perplexity": {"dataset": perplexity_data, "seq_len": seq_len, "max_windows": max_windows} if perplexity_data else None,
        "business": {"dataset": business, "limit": limit} if business else None,
        "tasks": {"names": [name.strip() for name in tasks.split(",") if name.strip()], "limit": limit} if tasks else None,
        "gate": dict(_threshold(item) for item in gate) or None,
    }, source="llmc eval options")
    labels = [target if target not in targets[:index] else f"{target}#{index + 1}" for index, target in enumerate(targets)]
    report = evaluate_side_by_side([EvalTarget(label, target) for label, target in zip(labels, targets)], config)
    if out is not None:
        write_report(report, out)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        table = Table(*SUMMARY_COLUMNS, title=f"baseline: {targets[0]}")
        for row in summary_rows(report):
            table.add_row(*row)
        console.print(table)
        if out is not None:
            console.print(f"report: {out / 'report.md'}")
    if "gate" in report and not report["gate"]["passed"]:
        raise GateFailed("gate failed:\n  " + "\n  ".join(report["gate"]["failures"]))


def _threshold(assignment: str) -> tuple[str, str]:
    key, separator, value = assignment.partition("=")
    if not separator:
        raise LlmcError(f"--gate expects KEY=VALUE (e.g. min_recovery=0.95), got {assignment!r}")
    return key.strip(), value.strip()


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def inspect(artifact: Path, as_json: bool) -> None:
    """Show what an artifact holds: formats, layers, calibration, evals, files."""
    from llmc.artifact.inspect import describe_artifact, print_artifact

    info = describe_artifact(artifact)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        print_artifact(info, console)


def main() -> None:
    try:
        cli(standalone_mode=False)
    except LlmcError as error:
        click.echo(f"error: {error}", err=True)
        sys.exit(error.exit_code)
    except click.exceptions.Abort:
        click.echo("interrupted; nothing was written", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("interrupted; nothing was written", err=True)
        sys.exit(130)
    except click.ClickException as error:
        error.show()
        sys.exit(error.exit_code)
