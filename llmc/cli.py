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


def engine_options(command):
    """Options shared by every command that builds an in-process engine."""
    options = [
        click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True,
                     help="bfloat16 runs int4 weights on torch's int4 kernel; float32 is the exact reference path."),
        click.option("--kv-cache-gib", type=click.FloatRange(min=0.001), default=1.0, show_default=True),
        click.option("--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True),
        click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=512, show_default=True),
        click.option("--max-model-len", type=click.IntRange(min=2)),
        click.option("--no-prefix-caching", is_flag=True),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def build_engine(model: str, dtype: str, kv_cache_gib: float, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None, no_prefix_caching: bool):
    import torch

    from llmc.runtime.config import EngineConfig
    from llmc.runtime.engine import LLMEngine

    config = EngineConfig(
        dtype=getattr(torch, dtype), kv_cache_gib=kv_cache_gib, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, enable_prefix_caching=not no_prefix_caching,
    )
    return LLMEngine(model, config)


@cli.command()
@click.argument("artifact")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", envvar="LLMC_API_KEY", help="Require `Authorization: Bearer KEY` on /v1 (or set LLMC_API_KEY).")
@click.option("--served-model-name", help="The model name clients send (default: ARTIFACT as given).")
@click.option("--max-waiting", type=click.IntRange(min=0), default=128, show_default=True,
              help="Requests queued beyond --max-num-seqs before the server answers 503.")
@engine_options
def serve(artifact: str, host: str, port: int, api_key: str | None, served_model_name: str | None, max_waiting: int, **engine_kwargs) -> None:
    """Serve ARTIFACT (or any model spec) over an OpenAI-compatible HTTP API."""
    from llmc.runtime.async_engine import AsyncLLMEngine
    from llmc.runtime.server import serve as run_server

    engine = AsyncLLMEngine(build_engine(artifact, **engine_kwargs), max_waiting)
    run_server(engine, served_model_name or artifact, host, port, api_key)


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
