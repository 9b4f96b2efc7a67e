import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from llmc.errors import LlmcError

console = Console()
SPECULATIVE_SHAPE_OPTIONS = [
    click.option("--num-speculative-tokens", type=click.IntRange(min=1), help="Draft depth (default: one per Medusa head, 4 for EAGLE)."),
    click.option("--speculative-tree-nodes", type=click.IntRange(min=0),
                 help="Verify a tree of this many draft nodes, the most probable paths; 0 drafts a chain (default: 7)."),
    click.option("--speculative-min-confidence", type=click.FloatRange(0, 1, max_open=True),
                 help="Verify only draft nodes whose path the draft finds at least this probable, and draft no deeper "
                      "(default: 0.3 for EAGLE, 0 for Medusa)."),
]


def with_options(options: list):
    """Several click options as one decorator."""
    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


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
@click.option("--business", metavar="FILE", help="Business eval set (JSONL).")
@click.option("--tasks", metavar="NAMES", help="lm-eval tasks, comma-separated: names or task YAML files.")
@click.option("--limit", type=click.IntRange(min=1), help="Only the first N business items and task documents.")
@click.option("--gate", "gate", multiple=True, metavar="KEY=VALUE",
              help="Threshold, e.g. min_recovery=0.95, max_perplexity_increase=0.05, max_kl=0.1, min_agreement=0.8.")
@click.option("--out", type=click.Path(path_type=Path), help="Write report.json, report.md and PNG charts here.")
@click.option("--speculative", metavar="auto|DRAFT_DIR", help="Measure speculative decoding with these draft heads (auto: TARGET/draft).")
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), help="JSONL prompts for --speculative (MT-bench `turns`, ...).")
@click.option("--num-prompts", type=click.IntRange(min=1), default=80, show_default=True, help="With --speculative.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True, help="With --speculative.")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True, help="With --speculative: also compare throughput with this many requests in flight.")
@click.option("--histogram", type=click.Path(path_type=Path), help="With --speculative: the accepted-length histogram (PNG).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@with_options(SPECULATIVE_SHAPE_OPTIONS)
def evaluate(targets: tuple[str, ...], perplexity_data: str | None, seq_len: int, max_windows: int, business: str | None,
             tasks: str | None, limit: int | None, gate: tuple[str, ...], out: Path | None, speculative: str | None,
             prompts_file: Path | None, num_prompts: int, max_tokens: int, concurrency: int, histogram: Path | None,
             as_json: bool, num_speculative_tokens: int | None, speculative_tree_nodes: int | None,
             speculative_min_confidence: float | None) -> None:
    """Evaluate TARGETS (model specs or artifacts) side by side; the first is the baseline."""
    if speculative is not None:
        shape = {"num_speculative_tokens": num_speculative_tokens, "speculative_tree_nodes": speculative_tree_nodes,
                 "speculative_min_confidence": speculative_min_confidence}
        return evaluate_speculative(targets[0], speculative, prompts_file, num_prompts, max_tokens, concurrency, histogram, as_json, shape)
    from llmc.evals.config import eval_config
    from llmc.evals.gate import GateFailed
    from llmc.evals.report import SUMMARY_COLUMNS, summary_rows, write_report
    from llmc.evals.suite import EvalTarget, evaluate_side_by_side

    if not (perplexity_data or business or tasks):
        raise LlmcError("nothing to evaluate: pass --perplexity FILE|wikitext2, --business FILE, --tasks NAMES or --speculative")
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


def evaluate_speculative(target: str, speculative: str, prompts_file: Path | None, num_prompts: int, max_tokens: int,
                         concurrency: int, histogram: Path | None, as_json: bool, shape: dict) -> None:
    import torch
    from transformers import AutoTokenizer

    from llmc.evals.speculative import plot_accepted_lengths, speculative_eval
    from llmc.models.spec import resolve_model
    from llmc.prompts import distinct_prompts

    if prompts_file is None:
        raise LlmcError("--speculative needs --prompts FILE (e.g. MT-bench question.jsonl)")
    draft = draft_folder(target, speculative)
    if draft is None:
        raise LlmcError(f"{target} has no draft heads; train them with `llmc train-draft {target}` or pass their folder")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(target))
    prompts = distinct_prompts(prompts_file, num_prompts, tokenizer)
    result = speculative_eval(target, draft, prompts, max_tokens, concurrency, torch.bfloat16, shape)
    if histogram:
        plot_accepted_lengths(result["accepted_length_histogram"], histogram, f"{target}: accepted length")
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    table = Table("metric", "value", title=f"speculative decoding, {len(prompts)} prompts of {prompts_file}, greedy")
    table.add_row("mean accepted length", f"{result['mean_accepted_length']:.2f}")
    table.add_row("tokens per step, undrafted steps included", f"{result['tokens_per_step']:.2f}")
    table.add_row("acceptance per position", ", ".join(f"{value:.2f}" for value in result["acceptance_per_position"]))
    table.add_row("identical to plain decoding", f"{result['identical_outputs']} / {len(prompts)}")
    batch1 = result["batch1"]
    table.add_row("batch 1 tokens/s plain / speculative", f"{batch1['plain_tokens_per_s']:.1f} / {batch1['speculative_tokens_per_s']:.1f}")
    table.add_row("batch 1 speed-up, drafting every step / as served", f"x{batch1['speedup']:.2f} / x{batch1['served_speedup']:.2f}")
    if f"concurrency{concurrency}" in result:
        loaded = result[f"concurrency{concurrency}"]
        table.add_row(f"concurrency {concurrency} speed-up, drafting every step / as served", f"x{loaded['speedup']:.2f} / x{loaded['served_speedup']:.2f}")
    console.print(table)


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def inspect(artifact: Path, as_json: bool) -> None:
    """Show what an artifact holds: formats, layers, calibration, evals, files."""
    from llmc.inspect import describe_artifact, print_artifact

    info = describe_artifact(artifact)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        print_artifact(info, console)


@cli.command(name="train-draft")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompts", type=click.Path(path_type=Path), multiple=True,
              help="JSONL training prompts, repeatable (default: the project's two calib_data sets).")
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE", help="Set a `draft:` field, e.g. --set steps=600.")
def train_draft_command(artifact: Path, prompts: tuple[Path, ...], overrides: tuple[str, ...]) -> None:
    """Train draft heads on ARTIFACT's own answers and store them in ARTIFACT/draft."""
    from llmc.draft.build import train_draft
    from llmc.draft.config import DraftConfig
    from llmc.overrides import apply_overrides
    from llmc.validation import validated

    fields: dict = {"prompts": [str(file) for file in prompts]} if prompts else {}
    apply_overrides(fields, list(overrides))
    config = validated(DraftConfig, fields, "llmc train-draft options", prefix="draft.")
    folder = train_draft(artifact, config)
    console.print(f"[green]wrote[/] {folder}")


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
        click.option("--speculative", default="auto", show_default=True, metavar="auto|off|DRAFT_DIR",
                     help="Draft heads to decode with: auto uses the artifact's draft/ when it has one."),
        click.option("--speculative-max-num-seqs", type=click.IntRange(min=0), default=4, show_default=True,
                     help="Decode without drafts when more sequences than this run at once."),
        *SPECULATIVE_SHAPE_OPTIONS,
    ]
    return with_options(options)(command)


def require_serve_extra() -> None:
    try:
        import fastapi
        import httpx
        import prometheus_client
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise LlmcError(f"{error.name} is not installed: pip install 'llmc-toolchain[serve]'") from None


def draft_folder(model: str, speculative: str) -> Path | None:
    """auto: MODEL/draft when MODEL is an artifact with heads; off: none; else the folder given."""
    from llmc.runtime.speculative.store import DRAFT_DIR

    if speculative == "off":
        return None
    if speculative == "auto":
        folder = Path(model) / DRAFT_DIR
        return folder if (folder / "config.json").is_file() else None
    return Path(speculative)


def build_engine(model: str, dtype: str, kv_cache_gib: float, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None, no_prefix_caching: bool, speculative: str = "off", speculative_max_num_seqs: int = 4,
                 num_speculative_tokens: int | None = None, speculative_tree_nodes: int | None = None,
                 speculative_min_confidence: float | None = None):
    import torch

    from llmc.runtime.engine.config import EngineConfig
    from llmc.runtime.llm_engine import LLMEngine

    config = EngineConfig(
        dtype=getattr(torch, dtype), kv_cache_gib=kv_cache_gib, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, enable_prefix_caching=not no_prefix_caching,
        speculative=draft_folder(model, speculative), speculative_max_num_seqs=speculative_max_num_seqs,
        num_speculative_tokens=num_speculative_tokens, speculative_tree_nodes=speculative_tree_nodes,
        speculative_min_confidence=speculative_min_confidence,
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
    require_serve_extra()
    from llmc.runtime.serving.async_engine import AsyncLLMEngine
    from llmc.runtime.serving.server import serve as run_server

    engine = AsyncLLMEngine(build_engine(artifact, **engine_kwargs), max_waiting)
    run_server(engine, served_model_name or artifact, host, port, api_key)


@cli.command()
@click.argument("model")
@click.option("--dataset", type=click.Path(path_type=Path), required=True, help="JSONL prompts (MT-bench `turns`, or `prompt`/`text`).")
@click.option("--url", help="Benchmark a running server (e.g. http://127.0.0.1:8000) instead of an in-process engine.")
@click.option("--api-key", envvar="LLMC_API_KEY")
@click.option("--num-prompts", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=16, show_default=True, help="Requests in flight at once.")
@click.option("--request-rate", type=click.FloatRange(min=0, min_open=True), help="Poisson arrivals (req/s) instead of fixed concurrency.")
@click.option("--cancel-fraction", type=click.FloatRange(0, 1), default=0.0, show_default=True, help="Share of requests cancelled mid-stream.")
@click.option("--shared-prefix-tokens", type=click.IntRange(min=0), default=0, show_default=True, help="Same system prompt of this many tokens before every prompt.")
@click.option("--chat-template/--raw", default=True, show_default=True, help="Wrap prompts in the model's chat template.")
@click.option("--baseline", type=click.Choice(["hf"]), help="Also run transformers generate (float32, one request at a time).")
@click.option("--baseline-num-prompts", type=click.IntRange(min=1), help="Run the baseline on the first N prompts only.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the results here as JSON.")
@engine_options
def bench(model: str, dataset: Path, url: str | None, api_key: str | None, num_prompts: int, max_tokens: int, concurrency: int,
          request_rate: float | None, cancel_fraction: float, shared_prefix_tokens: int, chat_template: bool,
          baseline: str | None, baseline_num_prompts: int | None, seed: int, json_path: Path | None, **engine_kwargs) -> None:
    """Load-test MODEL (artifact or model spec) in process, or the server at --url that serves it."""
    require_serve_extra()
    import asyncio

    from transformers import AutoTokenizer

    from llmc import bench as runtime_bench
    from llmc.models.spec import resolve_model
    from llmc.prompts import load_prompts
    from llmc.runtime.serving.async_engine import AsyncLLMEngine

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    prompts = load_prompts(dataset, num_prompts, tokenizer, chat_template, shared_prefix_tokens)
    load = dict(max_tokens=max_tokens, concurrency=None if request_rate else concurrency, request_rate=request_rate,
                cancel_fraction=cancel_fraction, seed=seed)
    if url:
        prompt_tokens = [len(tokenizer.encode(prompt, add_special_tokens=False)) for prompt in prompts]
        results = {"llmc": asyncio.run(runtime_bench.bench_url(url.rstrip("/"), model, api_key, prompts, prompt_tokens, **load))}
    else:
        engine = AsyncLLMEngine(build_engine(model, **engine_kwargs), max_waiting=num_prompts)
        results = {"llmc": asyncio.run(runtime_bench.bench_engine(engine, prompts, **load))}
    if baseline:
        results["hf"] = runtime_bench.hf_baseline(model, prompts[:baseline_num_prompts], max_tokens)
        results["speedup"] = {
            "output_throughput": results["llmc"]["output_throughput"] / results["hf"]["output_throughput"],
            "tpot_p50": results["hf"]["tpot"]["p50_ms"] / results["llmc"]["tpot"]["p50_ms"],
        }
    results["settings"] = {"model": model, "dataset": str(dataset), "num_prompts": num_prompts, "url": url} | load | engine_kwargs
    print_bench(results)
    if json_path:
        json_path.write_text(json.dumps(results, indent=2))


def print_bench(results: dict) -> None:
    runs = [name for name in ("llmc", "hf") if name in results]
    table = Table("metric", *runs, title="llmc bench")
    rows = [("completed / cancelled", lambda r: f"{r['completed']} / {r['cancelled']}"),
            ("output tokens/s", lambda r: f"{r['output_throughput']:.1f}"),
            ("requests/s", lambda r: f"{r['request_throughput']:.3f}")]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for p in (50, 90, 99):
            rows.append((f"{metric.upper()} p{p} (ms)", lambda r, m=metric, p=p: f"{r[m].get(f'p{p}_ms', float('nan')):.1f}"))
    for label, cell in rows:
        table.add_row(label, *(cell(results[name]) for name in runs))
    console.print(table)
    extras = {k: v for k, v in results["llmc"].items() if k.startswith(("kv_", "leaked", "preempt", "ttft_first", "ttft_later"))}
    console.print(extras)
    if "speedup" in results:
        console.print(f"llmc / hf: output throughput x{results['speedup']['output_throughput']:.2f}, "
                      f"TPOT p50 x{results['speedup']['tpot_p50']:.2f}")


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
