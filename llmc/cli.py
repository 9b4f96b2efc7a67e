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
    if not loaded.needs_calibration:
        unused = "; its calibration section only measures each layer's output error" if loaded.calibration else ""
        console.print(f"data-free: no stage of {recipe.name} needs calibration data{unused}")
    artifact = run_quantize(loaded, overwrite)
    console.print(f"[green]wrote[/] {artifact}")


@cli.command(name="eval")
@click.argument("targets", nargs=-1, required=True)
@click.option("--perplexity", "perplexity_data", metavar="FILE|NAME", help="Text file, or `wikitext2` (hub).")
@click.option("--seq-len", default=1024, show_default=True, type=click.IntRange(min=2))
@click.option("--max-windows", default=40, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
def evaluate(targets: tuple[str, ...], perplexity_data: str | None, seq_len: int, max_windows: int, as_json: bool) -> None:
    """Evaluate TARGETS (model specs or artifacts) side by side; the first is the baseline."""
    from llmc.evals.perplexity import load_eval_text, perplexity
    from llmc.models.loading import load_model

    if perplexity_data is None:
        raise LlmcError("nothing to evaluate: pass --perplexity FILE|wikitext2")
    text = load_eval_text(perplexity_data)
    results = []
    for target in targets:
        loaded = load_model(target)
        result = perplexity(loaded.model, loaded.tokenizer, text, perplexity_data, seq_len, max_windows, label=target)
        results.append({"target": target} | result.to_dict())
    if as_json:
        click.echo(json.dumps(results[0] if len(results) == 1 else results, indent=2))
        return
    table = Table("target", "perplexity", "vs first", "tokens", title=f"perplexity on {perplexity_data}")
    for result in results:
        delta = result["perplexity"] / results[0]["perplexity"] - 1
        table.add_row(result["target"], f"{result['perplexity']:.3f}", f"{delta:+.2%}", str(result["tokens"]))
    console.print(table)


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
