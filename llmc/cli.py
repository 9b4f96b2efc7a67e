"""`llmc`: each command parses its options, calls one function and prints what it returns. Defaults come from the
config classes the options fill."""
import dataclasses
import json
import os
import sys
from pathlib import Path

import click
from click.core import ParameterSource
from rich.console import Console

from llmc.bench.goodput import SearchLimits, Slo
from llmc.bench.ladder_settings import LadderSettings
from llmc.core.errors import LlmcError
from llmc.draft.config import DraftConfig
from llmc.evals.config import PerplexityEval
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.serving import DEFAULT_MAX_WAITING
from llmc.runtime.serving.limits import HEALTH_STALL_SECONDS, MAX_REQUEST_BYTES
from llmc.runtime.speculative.shape import DEFAULT_SHAPES

console = Console()


def engine_default(name: str):
    return next(field.default for field in dataclasses.fields(EngineConfig) if field.name == name)


def shape_defaults(attribute: str, show=str) -> str:
    return ", ".join(f"{show(getattr(shape, attribute))} for {method}" for method, shape in DEFAULT_SHAPES.items())


SPECULATIVE_SHAPE_OPTIONS = [
    click.option("--num-speculative-tokens", type=click.IntRange(min=1),
                 help=f"Draft depth (default: {shape_defaults('depth', lambda depth: depth or 'one per head')})."),
    click.option("--speculative-tree-nodes", type=click.IntRange(min=0),
                 help="Verify a tree of this many draft nodes, the most probable paths; 0 drafts a chain "
                      f"(default: {shape_defaults('num_nodes')})."),
    click.option("--speculative-min-confidence", type=click.FloatRange(0, 1, max_open=True),
                 help="Verify only draft nodes whose path the draft finds at least this probable, and draft no deeper "
                      f"(default: {shape_defaults('min_confidence')})."),
]


def with_options(options: list):
    """Several click options as one decorator."""
    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


DEVICE_OPTION = click.option("--device", default="auto", show_default=True,
                             help="auto (the first CUDA device, else the CPU), cpu, cuda or cuda:N.")


def chosen_device(name: str):
    """--device resolved and printed, before any work."""
    from llmc.core.device import describe_device, resolve_device

    try:
        device = resolve_device(name)
    except LlmcError as error:
        raise LlmcError(f"--device: {error}") from None
    click.echo(f"device: {describe_device(device)}", err=True)
    return device


@click.group()
@click.version_option(package_name="llmc-toolchain")
def cli() -> None:
    """llmc: quantize, evaluate and serve LLMs."""


@cli.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--output", "-o", help="Artifact folder (overrides the recipe's `output`).")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a recipe field.")
@click.option("--overwrite", is_flag=True, help="Replace an existing artifact folder.")
@click.option("--resume", is_flag=True,
              help="Continue a stopped or killed run of this recipe after its last intact layer, or with its evals or draft.")
@click.option("--discard-partial", is_flag=True, help="Remove the finished layers a stopped or killed run kept, and start again.")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Calibrate in N processes (torchrun), each on a share of the samples: one per GPU, or N CPU processes.")
def quantize(recipe: Path, output: str | None, overrides: tuple[str, ...], overwrite: bool, resume: bool, discard_partial: bool,
             nproc: int) -> None:
    """Run RECIPE (YAML) and write a compressed-tensors artifact."""
    from llmc.pipeline.preflight import resolve_eval_and_draft_inputs
    from llmc.pipeline.recipe import load_recipe

    loaded = load_recipe(recipe, list(overrides), output)
    # before the pipeline's imports: a missing input fails fast
    eval_inputs = resolve_eval_and_draft_inputs(loaded, overwrite, resume, discard_partial)
    if not loaded.needs_calibration:
        unused = "; its calibration section only measures each layer's output error" if loaded.calibration else ""
        console.print(f"data-free: no stage of {recipe.name} needs calibration data{unused}")
    if nproc > 1:
        from llmc.pipeline.launch import launch_ranks

        arguments = [str(recipe), *(["--output", output] if output else []), *(f"--set={item}" for item in overrides),
                     *(["--overwrite"] if overwrite else []), *(["--resume"] if resume else [])]
        launch_ranks(loaded, nproc, arguments)
        return
    from llmc.pipeline.quantize import run_quantize

    artifact = run_quantize(loaded, overwrite, eval_inputs, resume, discard_partial)
    if int(os.environ.get("RANK", "0")) == 0:
        console.print(f"[green]wrote[/] {artifact}")


@cli.command()
@click.argument("tune_file", metavar="TUNE", type=click.Path(path_type=Path))
@click.option("--output", "-o", help="Folder for the winning artifact (overrides the file's `output`).")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a field of TUNE.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--resume", is_flag=True, help="Continue a stopped or killed tune after its last finished evaluation.")
@click.option("--discard-partial", is_flag=True, help="Remove what a stopped or killed tune kept, and start again.")
def tune(tune_file: Path, output: str | None, overrides: tuple[str, ...], overwrite: bool, resume: bool,
         discard_partial: bool) -> None:
    """Find the cheapest mix of formats, Linear by Linear, that passes TUNE's gate, and write it as an artifact."""
    from llmc.tune.config import load_tune
    from llmc.tune.search import run_tune

    config = load_tune(tune_file, list(overrides), output)
    artifact = run_tune(config, overwrite, resume, discard_partial)
    console.print(f"[green]wrote[/] {artifact} (the tune's report: {artifact / 'tune' / 'report.md'})")


@cli.command(name="eval")
@click.argument("targets", nargs=-1, required=True)
@click.option("--perplexity", "perplexity_data", metavar="FILE|NAME", help="Text file, or `wikitext2` (hub).")
@click.option("--seq-len", default=PerplexityEval.model_fields["seq_len"].default, show_default=True, type=click.IntRange(min=2))
@click.option("--max-windows", default=PerplexityEval.model_fields["max_windows"].default, show_default=True,
              type=click.IntRange(min=1))
@click.option("--business", metavar="FILE", help="Business eval set (JSONL).")
@click.option("--tasks", metavar="NAMES", help="lm-eval tasks, comma-separated: names or task YAML files.")
@click.option("--allow-task-code", is_flag=True,
              help="Let a task YAML's `!function` tags run the Python files they name (refused by default).")
@click.option("--limit", type=click.IntRange(min=1), help="Only the first N business items and task documents.")
@click.option("--gate", "gate", multiple=True, metavar="KEY=VALUE",
              help="Threshold, e.g. min_recovery=0.95, max_perplexity_increase=0.05, max_kl=0.1, min_agreement=0.8.")
@click.option("--out", type=click.Path(path_type=Path), help="Write report.json, report.md and PNG charts here.")
@click.option("--speculative", metavar="auto|DRAFT_DIR", help="Measure speculative decoding with these draft heads (auto: TARGET/draft).")
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), help="JSONL prompts for --speculative (MT-bench `turns`, ...).")
@click.option("--num-prompts", type=click.IntRange(min=1), default=80, show_default=True, help="With --speculative.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True, help="With --speculative.")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --speculative: also compare throughput with this many requests in flight.")
@click.option("--histogram", type=click.Path(path_type=Path), help="With --speculative: the accepted-length histogram (PNG).")
@click.option("--vllm", metavar="VENV|EXECUTABLE",
              help="With --speculative: also measure the draft in vLLM (its venv or `vllm` executable), chains on both sides.")
@click.option("--vllm-arg", "vllm_args", multiple=True, metavar="ARG",
              help="With --vllm: an argument of `vllm serve` for both its runs, e.g. --vllm-arg=--enforce-eager; repeat for more.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@DEVICE_OPTION
@with_options(SPECULATIVE_SHAPE_OPTIONS)
def evaluate(**options) -> None:
    """Evaluate TARGETS (model specs or artifacts) side by side; the first is the baseline."""
    if options["vllm_args"] and options["vllm"] is None:
        raise LlmcError(f"--vllm-arg {' '.join(options['vllm_args'])}: only with --vllm")
    if options["speculative"] is not None:
        evaluate_draft(options_as(DraftEval, options))
        return
    if options["vllm"] is not None:
        raise LlmcError("--vllm measures a draft in vLLM: it goes with --speculative")
    evaluate_targets(options_as(TargetsEval, options))


def options_as(record: type, options: dict):
    """The dataclass `record` with the command's options of its fields' names."""
    return record(**{field.name: options[field.name] for field in dataclasses.fields(record)})


@dataclasses.dataclass
class TargetsEval:
    """`llmc eval TARGETS...`: the quality evals of each target, side by side with the first."""

    targets: tuple[str, ...]
    perplexity_data: str | None
    seq_len: int
    max_windows: int
    business: str | None
    tasks: str | None
    allow_task_code: bool
    limit: int | None
    gate: tuple[str, ...]
    out: Path | None
    as_json: bool
    device: str


def evaluate_targets(options: TargetsEval) -> None:
    from llmc.evals.config import options_eval_config
    from llmc.evals.inputs import load_eval_inputs

    config = options_eval_config(options.perplexity_data, options.seq_len, options.max_windows, options.business, options.tasks,
                                 options.limit, list(options.gate), options.allow_task_code)
    eval_device = chosen_device(options.device)
    inputs = load_eval_inputs(config)  # before the models' imports: a missing input fails fast
    from llmc.evals.gate import require_gate_passed
    from llmc.evals.report import summary_table, write_report
    from llmc.evals.suite import evaluate_specs

    report = evaluate_specs(list(options.targets), config, inputs, eval_device)
    if options.out is not None:
        write_report(report, options.out)
    if options.as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        console.print(summary_table(report, title=f"baseline: {options.targets[0]}"))
        if options.out is not None:
            console.print(f"report: {options.out / 'report.md'}")
    require_gate_passed(report)


@dataclasses.dataclass
class DraftEval:
    """`llmc eval TARGET --speculative auto|DRAFT_DIR`: speculative decoding measured with TARGET's draft heads."""

    targets: tuple[str, ...]  # the first is measured
    speculative: str
    prompts_file: Path | None
    num_prompts: int
    max_tokens: int
    concurrency: int
    histogram: Path | None
    vllm: str | None
    vllm_args: tuple[str, ...]
    gate: tuple[str, ...]
    as_json: bool
    device: str
    num_speculative_tokens: int | None
    speculative_tree_nodes: int | None
    speculative_min_confidence: float | None

    @property
    def shape(self) -> dict:
        """The draft shape options, as the speculative decoder takes them (None: the method's default)."""
        return {"num_speculative_tokens": self.num_speculative_tokens, "speculative_tree_nodes": self.speculative_tree_nodes,
                "speculative_min_confidence": self.speculative_min_confidence}


def evaluate_draft(options: DraftEval) -> None:
    from llmc.evals.gate import check_accepted_length
    from llmc.evals.speculative import evaluate_speculative, speculative_table

    target = options.targets[0]
    draft_gate = speculative_gate(list(options.gate))
    result = evaluate_speculative(target, options.speculative, options.prompts_file, options.num_prompts, options.max_tokens,
                                  options.concurrency, options.histogram, options.shape, chosen_device(options.device), options.vllm,
                                  options.vllm_args)
    if options.as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        console.print(speculative_table(result))
    check_accepted_length(result["mean_accepted_length"], draft_gate, f"{target}'s draft on {options.prompts_file}")


@cli.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def inspect(artifact: Path, as_json: bool) -> None:
    """Show what an artifact holds: formats, layers, calibration, evals, files."""
    from llmc.pipeline.inspect_artifact import describe_artifact, print_artifact

    info = describe_artifact(artifact)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        print_artifact(info, console)


def speculative_gate(assignments: list[str]):
    """--gate with --speculative: min_accepted_length is the one threshold a draft's measurement holds."""
    from llmc.core.validation import validated
    from llmc.evals.config import gate_thresholds
    from llmc.evals.gate import GateConfig

    thresholds = gate_thresholds(assignments)
    others = sorted(set(thresholds) - {"min_accepted_length"})
    if others:
        raise LlmcError(f"--gate {others[0]}: --speculative measures the draft, its gate is min_accepted_length")
    return validated(GateConfig, thresholds, "llmc eval --gate", prefix="gate.")


@cli.command(name="train-draft")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompts", type=click.Path(path_type=Path), multiple=True,
              help=f"JSONL training prompts, repeatable (default: {', '.join(DraftConfig.model_fields['prompts'].default)}).")
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE", help="Set a `draft:` field, e.g. --set steps=600.")
@DEVICE_OPTION
def train_draft_command(artifact: Path, prompts: tuple[Path, ...], overrides: tuple[str, ...], device: str) -> None:
    """Train draft heads on ARTIFACT's own answers and store them in ARTIFACT/draft (trained in a copy of ARTIFACT that
    replaces it when done: an error or Ctrl-C leaves ARTIFACT as it was)."""
    from llmc.core.overrides import apply_overrides
    from llmc.core.validation import validated
    from llmc.draft.build import train_draft_into_copy

    fields: dict = {"prompts": [str(file) for file in prompts]} if prompts else {}
    apply_overrides(fields, list(overrides))
    config = validated(DraftConfig, fields, "llmc train-draft options", prefix="draft.")
    folder = train_draft_into_copy(artifact, config, chosen_device(device))
    console.print(f"[green]wrote[/] {folder}")


ENGINE_OPTIONS = [
    click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default=str(engine_default("dtype")).removeprefix("torch."),
                 show_default=True, help="bfloat16 runs int4 weights on torch's int4 kernels; float32 is the exact reference path."),
    click.option("--kv-cache-gib", type=click.FloatRange(min=0.001), default=engine_default("kv_cache_gib"), show_default=True),
    click.option("--max-num-seqs", type=click.IntRange(min=1), default=engine_default("max_num_seqs"), show_default=True),
    click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=engine_default("max_num_batched_tokens"),
                 show_default=True),
    click.option("--max-model-len", type=click.IntRange(min=2)),
    click.option("--no-prefix-caching", is_flag=True),
    click.option("--speculative", default="auto", show_default=True, metavar="auto|off|DRAFT_DIR",
                 help="Draft heads to decode with: auto uses the artifact's draft/ when it has one."),
    click.option("--speculative-max-num-seqs", type=click.IntRange(min=0), default=engine_default("speculative_max_num_seqs"),
                 show_default=True, help="Decode without drafts when more sequences than this run at once."),
    *SPECULATIVE_SHAPE_OPTIONS,
    DEVICE_OPTION,
    click.option("--amx-int4/--no-amx-int4", default=engine_default("amx_int4"), show_default=True,
                 help="CPU with AMX, bfloat16: int4 layers compiled onto inductor's AMX int4 GEMM at start (cached on disk)."),
    click.option("--int4-dense-copy/--no-int4-dense-copy", default=engine_default("int4_dense_copy"), show_default=True,
                 help="CPU without AMX, bfloat16: int4 layers keep a bfloat16 copy of their weights (4x their memory) for steps "
                 "of more than --max-eager-int4-rows tokens, where a dense GEMM beats the int4 kernel."),
    click.option("--max-eager-int4-rows", type=click.IntRange(min=0), default=engine_default("max_eager_int4_rows"),
                 show_default=True, help="Steps of at most this many tokens keep torch's eager int4 kernel, faster for few "
                 "rows; larger ones run on AMX or the dense copy. 0 puts every step there, so a token's bits do not depend on "
                 "the batch."),
    click.option("--cpu-decode-stack/--no-cpu-decode-stack", default=engine_default("cpu_decode_stack"), show_default=True,
                 help="CPU, bfloat16, 4-bit weights: decode steps of at most --max-eager-int4-rows tokens run the whole decoder "
                 "stack in one C++ call where the model's layers allow (plain pre-norm attention, SiLU MLP, no experts)."),
    click.option("--compile/--no-compile", "compile_layers", default=engine_default("compile"), show_default=True,
                 help="CPU: torch.compile the decoder layers' pieces around the attention (compiled at start, cached on disk)."),
]


def engine_config(model: str, dtype: str, no_prefix_caching: bool, speculative: str, device: str, compile_layers: bool,
                  **options) -> EngineConfig:
    """The engine ENGINE_OPTIONS describe; the other options are EngineConfig's fields as they are."""
    import torch

    from llmc.runtime.speculative.store import draft_folder

    return EngineConfig(dtype=getattr(torch, dtype), enable_prefix_caching=not no_prefix_caching,
                        speculative=draft_folder(model, speculative), device=str(chosen_device(device)),
                        compile=compile_layers, **options)


def build_engine(model: str, **engine_options):
    from llmc.runtime.llm import LLM

    return LLM(model, engine_config(model, **engine_options))


def explicit_options(ctx: click.Context, options: dict) -> dict:
    """The options set on the command line or in the environment, not left at their defaults."""
    defaults = (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)
    return {name: value for name, value in options.items() if ctx.get_parameter_source(name) not in defaults}


def require_serve_extra() -> None:
    import importlib.util

    missing = [name for name in ("fastapi", "httpx", "msgspec", "prometheus_client", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise LlmcError(f"{missing[0]} is not installed: pip install 'llmc-toolchain[serve]'")


@cli.command()
@click.argument("artifact")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- VLLM_ARGS...]")
@click.option("--engine", type=click.Choice(["llmc", "vllm"]), default="llmc", show_default=True,
              help="vllm: hand serving to `vllm serve` with the options below that it shares; VLLM_ARGS after `--` go to it.")
@click.option("--vllm", "vllm_executable", metavar="PATH",
              help="The `vllm` executable for --engine vllm (default: `vllm` on PATH, else the repository's .vllm-venv/bin/vllm).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", envvar="LLMC_API_KEY", help="Require `Authorization: Bearer KEY` on /v1 (or set LLMC_API_KEY).")
@click.option("--served-model-name", help="The model name clients send (default: ARTIFACT as given).")
@click.option("--max-waiting", type=click.IntRange(min=0), default=DEFAULT_MAX_WAITING, show_default=True,
              help="Requests queued beyond --max-num-seqs before the server answers 503.")
@click.option("--threads", type=click.IntRange(min=1),
              help="CPU threads for the engine's math, which runs in its own process beside the HTTP server's (default: all cores).")
@click.option("--max-request-bytes", type=click.IntRange(min=1024), default=MAX_REQUEST_BYTES, show_default=True,
              help="Larger request bodies get 413 before they are read in full or parsed.")
@click.option("--health-stall-seconds", type=click.FloatRange(min=1), default=HEALTH_STALL_SECONDS, show_default=True,
              help="/health answers 503 when the engine has not answered for this long (it replies every second "
                   "between steps), as well as once it has died.")
@with_options(ENGINE_OPTIONS)
@click.pass_context
def serve(ctx: click.Context, artifact: str, vllm_args: tuple[str, ...], engine: str, vllm_executable: str | None, host: str,
          port: int, api_key: str | None, served_model_name: str | None, max_waiting: int, threads: int | None,
          max_request_bytes: int, health_stall_seconds: float, **engine_options) -> None:
    """Serve ARTIFACT (or any model spec) over an OpenAI-compatible HTTP API."""
    if (api_key is not None and not api_key.strip()) or os.environ.get("LLMC_API_KEY") == "":  # click reads "" as unset
        raise LlmcError("--api-key (or LLMC_API_KEY) is empty: give a key, or unset LLMC_API_KEY to serve without one")
    if engine == "vllm":
        from llmc.external.vllm_server import exec_vllm, find_vllm, vllm_command

        options = explicit_options(ctx, engine_options | {"max_waiting": max_waiting, "threads": threads,
                                                          "max_request_bytes": max_request_bytes,
                                                          "health_stall_seconds": health_stall_seconds})
        exec_vllm(vllm_command(find_vllm(vllm_executable), artifact, host, port, api_key, served_model_name or artifact, options,
                               vllm_args))
    if vllm_args or vllm_executable is not None:
        given = "--vllm" if vllm_executable is not None else " ".join(vllm_args)
        raise LlmcError(f"{given}: only with --engine vllm")
    require_serve_extra()
    from llmc.checkpoints.spec import resolve_model
    from llmc.runtime.serving.engine_process import EngineProcess
    from llmc.runtime.serving.server import serve as run_server

    config = engine_config(artifact, **engine_options)
    engine = EngineProcess(resolve_model(artifact), config, threads or os.cpu_count() or 1, max_waiting, health_stall_seconds)
    run_server(engine, served_model_name or artifact, host, port, api_key, max_request_bytes)


LADDER_OPTIONS = [
    click.option("--ladder", is_flag=True, help="Run the optimisation ladder on MODEL: transformers, llmc, quantized weights, "
                 "FP8 KV cache, draft heads (and vLLM with --vllm), each as goodput at the SLO."),
    click.option("--recipe", type=click.Path(path_type=Path), help="--ladder: the recipe the quantized rungs are made by."),
    click.option("--quantized", type=click.Path(path_type=Path), help="--ladder: the quantized rung's artifact (instead of --recipe's)."),
    click.option("--fp8-kv", type=click.Path(path_type=Path), help="--ladder: the FP8 KV cache rung's artifact."),
    click.option("--draft", type=click.Path(path_type=Path),
                 help="--ladder: draft heads for the last rung (a draft folder, or an artifact with draft/)."),
    click.option("--vllm", "vllm_path", metavar="auto|off|PATH", default="auto", show_default=True,
                 help="--ladder: vLLM beside the unquantized and quantized rungs: found as `serve --engine vllm` finds it, "
                 "none, or its venv or `vllm`."),
    click.option("--slo-ttft-ms", type=click.FloatRange(min=0, min_open=True), default=Slo.ttft_p90_ms, show_default=True,
                 help="--ladder: the SLO's p90 time to first token."),
    click.option("--slo-tpot-ms", type=click.FloatRange(min=0, min_open=True), default=Slo.tpot_p90_ms, show_default=True,
                 help="--ladder: the SLO's p90 time per output token."),
    click.option("--budget-s", type=click.FloatRange(min=1), default=LadderSettings.budget_s, show_default=True,
                 help="--ladder: seconds for all rungs' load tests, shared among the rungs (each runs one probe at least)."),
    click.option("--max-probes", type=click.IntRange(min=1), default=SearchLimits.max_probes, show_default=True,
                 help="--ladder: request rates tried per rung."),
    click.option("--probe-seconds", type=click.FloatRange(min=1), default=LadderSettings.probe_seconds, show_default=True,
                 help="--ladder: a probe sends at least as many requests as arrive in this long at its rate."),
    click.option("--hf-batch-size", type=click.IntRange(min=1), default=LadderSettings.hf_batch_size, show_default=True,
                 help="--ladder: the transformers rung's static batch size."),
    click.option("--quality-items", type=click.IntRange(min=0), default=LadderSettings.quality_items, show_default=True,
                 help="--ladder: business items of each rung's quality comparison against MODEL (0: none)."),
    click.option("--out", type=click.Path(path_type=Path), default=Path("ladder"), show_default=True,
                 help="--ladder: ladder.json, ladder.png, the quantized artifacts and the servers' logs."),
    click.option("--overwrite", is_flag=True, help="--ladder: replace an earlier ladder.json / ladder.png in --out."),
]
LADDER_NAMES = ("ladder", "recipe", "quantized", "fp8_kv", "draft", "vllm_path", "slo_ttft_ms", "slo_tpot_ms", "budget_s",
                "max_probes", "probe_seconds", "hf_batch_size", "quality_items", "out", "overwrite")
BENCH_ONLY = ("url", "request_rate", "cancel_fraction", "shared_prefix_tokens", "chat_template", "baseline",
              "baseline_num_prompts", "concurrency", "speculative")


@cli.command()
@click.argument("model")
@click.option("--dataset", type=click.Path(path_type=Path),
              help="JSONL prompts (MT-bench `turns`, or `prompt`/`text`); --ladder: the chat workload (default: the shipped "
              "business set).")
@click.option("--url", help="Benchmark a running server (e.g. http://127.0.0.1:8000) instead of an in-process engine.")
@click.option("--api-key", envvar="LLMC_API_KEY")
@click.option("--num-prompts", type=click.IntRange(min=1), default=LadderSettings.num_prompts, show_default=True,
              help="Requests (--ladder: per probed rate).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=16, show_default=True, help="Requests in flight at once.")
@click.option("--request-rate", type=click.FloatRange(min=0, min_open=True), help="Poisson arrivals (req/s) instead of fixed concurrency.")
@click.option("--cancel-fraction", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="Share of requests cancelled mid-stream.")
@click.option("--shared-prefix-tokens", type=click.IntRange(min=0), default=0, show_default=True,
              help="Same system prompt of this many tokens before every prompt.")
@click.option("--chat-template/--raw", default=True, show_default=True, help="Wrap prompts in the model's chat template.")
@click.option("--baseline", type=click.Choice(["hf"]), help="Also run transformers generate (float32, one request at a time).")
@click.option("--baseline-num-prompts", type=click.IntRange(min=1), help="Run the baseline on the first N prompts only.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the results here as JSON.")
@with_options(ENGINE_OPTIONS)
@with_options(LADDER_OPTIONS)
@click.pass_context
def bench(ctx: click.Context, model: str, dataset: Path | None, url: str | None, api_key: str | None, num_prompts: int,
          max_tokens: int, concurrency: int, request_rate: float | None, cancel_fraction: float, shared_prefix_tokens: int,
          chat_template: bool, baseline: str | None, baseline_num_prompts: int | None, seed: int, json_path: Path | None,
          **options) -> None:
    """Load-test MODEL (artifact or model spec) in process, or the server at --url that serves it; with --ladder, the
    optimisation ladder on it."""
    require_serve_extra()
    ladder = {name: options.pop(name) for name in LADDER_NAMES}
    if ladder.pop("ladder"):
        conflicting = list(explicit_options(ctx, dict.fromkeys(BENCH_ONLY)))
        if conflicting:
            raise LlmcError(f"--{conflicting[0].replace('_', '-')}: not with --ladder, which probes each rung at request "
                            "rates it chooses")
        return run_ladder_command(model, dataset, num_prompts, max_tokens, seed, json_path, ladder, options)
    stray = list(explicit_options(ctx, ladder))
    if stray:
        raise LlmcError(f"--{stray[0].replace('_', '-')}: only with --ladder")
    if dataset is None:
        raise LlmcError("--dataset: required (JSONL prompts), except with --ladder")
    from llmc.bench.command import bench_notes, bench_table, run_bench

    load = dict(max_tokens=max_tokens, concurrency=None if request_rate else concurrency, request_rate=request_rate,
                cancel_fraction=cancel_fraction, seed=seed)
    engine = None if url else build_engine(model, **options)
    results = run_bench(model, dataset, num_prompts, chat_template, shared_prefix_tokens, load, engine, url, api_key,
                        baseline_num_prompts, baseline == "hf")
    results["settings"] = {"model": model, "dataset": str(dataset), "num_prompts": num_prompts, "url": url} | load | options
    console.print(bench_table(results))
    for note in bench_notes(results):
        console.print(note)
    if json_path:
        json_path.write_text(json.dumps(results, indent=2))


def run_ladder_command(model: str, dataset: Path | None, num_prompts: int, max_tokens: int, seed: int,
                       json_path: Path | None, ladder: dict, engine_options: dict) -> None:
    from llmc.bench.ladder import RungArtifacts, RungContext
    from llmc.bench.ladder_command import DEFAULT_WORKLOAD, LadderInputs, check_inputs, run_ladder

    paths = {field.name: ladder[field.name] for field in dataclasses.fields(RungArtifacts)}
    given = RungArtifacts(**{name: None if path is None else str(path) for name, path in paths.items()})
    inputs = LadderInputs(model, dataset or DEFAULT_WORKLOAD, ladder["out"], ladder["vllm_path"], json_path, ladder["overwrite"])
    settings = LadderSettings(num_prompts, ladder["probe_seconds"], max_tokens, Slo(ladder["slo_ttft_ms"], ladder["slo_tpot_ms"]),
                              SearchLimits(max_probes=ladder["max_probes"]), ladder["budget_s"], ladder["hf_batch_size"],
                              ladder["quality_items"], seed)
    check_inputs(inputs, settings, given)
    artifacts = given
    if ladder["recipe"] is not None:  # its two recipes checked, then their artifacts written (given ones win)
        from llmc.pipeline.ladder_recipes import quantize_rungs

        made = quantize_rungs(ladder["recipe"], model, ladder["out"] / "artifacts", console)
        artifacts = RungArtifacts(**(made | {name: path for name, path in vars(given).items() if path is not None}))
    device = str(chosen_device(engine_options["device"]))

    def make_engine(rung_model: str, speculative: str):
        return build_engine(rung_model, **(engine_options | {"speculative": speculative, "device": device}))

    run_ladder(inputs, artifacts, settings, RungContext(make_engine, engine_options["max_num_seqs"], ladder["out"], device), console)


def main() -> None:
    try:
        cli(standalone_mode=False)
    except LlmcError as error:
        click.echo(f"error: {error}", err=True)
        sys.exit(error.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("interrupted", err=True)
        sys.exit(130)
    except click.ClickException as error:
        error.show()
        sys.exit(error.exit_code)
