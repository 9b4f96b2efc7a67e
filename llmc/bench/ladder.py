"""`llmc bench --ladder`: the optimisation ladder, one rung after another on the same prompts and device: transformers
`generate` in static batches, llmc's runtime unquantized, the quantized weights, an FP8 KV cache, draft heads; vLLM
beside the unquantized and quantized rungs where it is found. Each rung's figure is its goodput at the SLO
(goodput.py), with its latencies and memory at that rate; a rung that fails is reported in its row and the ladder
goes on."""
import asyncio
import math
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llmc.bench.goodput import Goodput, find_goodput
from llmc.bench.ladder_settings import LadderSettings
from llmc.bench.load import bench_engine, bench_url, run_load, summarize
from llmc.bench.model_memory import resident_bytes
from llmc.bench.static_batch import StaticBatchServer, model_dtype


@dataclass(frozen=True)
class RungArtifacts:
    quantized: str | None = None  # the quantized weights
    fp8_kv: str | None = None  # the same weights with an FP8 KV cache
    draft: str | None = None  # draft heads for the last rung: a draft folder, or an artifact holding draft/


@dataclass(frozen=True)
class Rung:
    name: str
    configuration: str
    engine: str  # transformers, llmc or vllm
    model: str | None  # a model spec or artifact; None when the rung cannot run (`missing` says why)
    speculative: str = "off"  # llmc's --speculative: off, auto or a draft folder
    missing: str | None = None


WARM_UP_BURST = 8  # requests sent at once before a rung's search


@dataclass
class RungResult:
    rung: Rung
    goodput: float | None = None  # requests/s at the SLO; 0.0 when even the lowest probed rate missed it
    goodput_is_lower_bound: bool = False  # every rate tried met the SLO: the search ran out of probes or budget first
    lowest_missed: float | None = None  # with goodput 0.0: that rate
    goodput_tokens_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p90_ms: float | None = None
    weights_bytes: int | None = None
    kv_bytes: int | None = None
    quality: dict | None = None  # business recovery, agreement and KL against the base model
    seconds: float = 0.0
    budget_s: float = 0.0
    stopped_by: str | None = None
    probes: list[dict] = field(default_factory=list)
    error: str | None = None

    @property
    def memory_bytes(self) -> int | None:
        return None if self.weights_bytes is None else self.weights_bytes + (self.kv_bytes or 0)

    def record(self) -> dict:
        return {"name": self.rung.name, "engine": self.rung.engine} | asdict(self) | {"memory_bytes": self.memory_bytes}


def plan_rungs(model: str, artifacts: RungArtifacts, vllm: str | None) -> list[Rung]:
    """The rungs in order; vLLM's after llmc's, on the unquantized and quantized weights."""
    quantized = artifacts.quantized
    no_recipe = "no quantized artifact: give --recipe (or the rung's artifact)"
    rungs = [Rung("transformers", f"transformers generate, static batches, {model_dtype(model)}".replace("torch.", ""),
                  "transformers", model),
             Rung("llmc", "llmc: paged KV, continuous batching, prefix cache", "llmc", model),
             Rung("quantized", "+ quantized weights", "llmc", quantized, missing=None if quantized else no_recipe)]
    fp8 = artifacts.fp8_kv
    rungs.append(Rung("fp8-kv", "+ FP8 KV cache", "llmc", fp8,
                      missing=None if fp8 else "no FP8 KV artifact: give --recipe (with calibration) or --fp8-kv DIR"))
    draft_base = fp8 or quantized
    if artifacts.draft is None:
        rungs.append(Rung("draft", "+ draft heads (speculative)", "llmc", None,
                          missing="no draft heads: give a recipe with a draft section, or --draft DIR"))
    else:
        draft = Path(artifacts.draft)
        speculative = str(draft / "draft") if (draft / "draft" / "config.json").is_file() else str(draft)
        rungs.append(Rung("draft", "+ draft heads (speculative)", "llmc", draft_base, speculative,
                          missing=None if draft_base else no_recipe))
    if vllm is not None:
        rungs.append(Rung("vllm", "vLLM, unquantized", "vllm", model))
        rungs.append(Rung("vllm-quantized", "vLLM, quantized weights", "vllm", quantized,
                          missing=None if quantized else no_recipe))
    return rungs


class RungServer:
    """What a probe needs from a rung: a stream per request (load.run_load's), or a URL, and its memory."""

    def probe(self, prompts: list[str], rate: float, settings: LadderSettings) -> dict:
        raise NotImplementedError

    def memory(self) -> tuple[int | None, int | None]:
        """(weights bytes, KV bytes at the peak of the probes so far)"""
        raise NotImplementedError


class TransformersRung(RungServer):
    def __init__(self, model: str, settings: LadderSettings, device: str):
        self.server = StaticBatchServer(model, settings.hf_batch_size, device)

    def probe(self, prompts: list[str], rate: float, settings: LadderSettings) -> dict:
        tokens = [len(self.server.tokenize(prompt)) for prompt in prompts]
        self.server.start()
        try:
            results, duration = asyncio.run(run_load(self.server.stream, prompts, tokens, settings.max_tokens, None, rate,
                                                     0.0, settings.seed))
        finally:
            self.server.stop()
        return summarize(results, duration)

    def memory(self) -> tuple[int | None, int | None]:
        return self.server.weight_bytes, self.server.peak_kv_bytes


class LlmcRung(RungServer):
    def __init__(self, llm):
        self.llm, self.peak_blocks = llm, 0

    def probe(self, prompts: list[str], rate: float, settings: LadderSettings) -> dict:
        from llmc.runtime.serving.async_engine import AsyncLLMEngine

        self.llm.block_manager.reset_prefix_cache()  # each probe sees the shared prefixes afresh, as the first did
        engine = AsyncLLMEngine(self.llm, max_waiting=len(prompts))
        summary = asyncio.run(bench_engine(engine, prompts, max_tokens=settings.max_tokens, concurrency=None,
                                           request_rate=rate, cancel_fraction=0.0, seed=settings.seed))
        self.peak_blocks = max(self.peak_blocks, summary["kv_peak_blocks_used"])
        return summary

    def memory(self) -> tuple[int | None, int | None]:
        cache = self.llm.runner.kv_cache
        return resident_bytes(self.llm.runner.model, exclude=cache), cache.nbytes // cache.shape[2] * self.peak_blocks


class VllmRung(RungServer):
    def __init__(self, model: str, vllm: str, max_num_seqs: int, log: Path, stack: ExitStack):
        from transformers import AutoTokenizer

        from llmc.evals.vllm_speculative import served_length, vllm_executable
        from llmc.external.vllm_server import LOCAL_SERVED_NAME, local_vllm

        self.model, self.name, self.tokenizer = model, LOCAL_SERVED_NAME, AutoTokenizer.from_pretrained(model)
        flags = ["--max-num-seqs", str(max_num_seqs), "--max-model-len", str(served_length(model))]
        # dev mode answers /reset_prefix_cache, so that every probe meets the shared prefixes afresh
        self.url = stack.enter_context(local_vllm(vllm_executable(vllm), model, flags, log, {"VLLM_SERVER_DEV_MODE": "1"}))

    def probe(self, prompts: list[str], rate: float, settings: LadderSettings) -> dict:
        import httpx

        httpx.post(f"{self.url}/reset_prefix_cache", timeout=60).raise_for_status()
        tokens = [len(self.tokenizer.encode(prompt, add_special_tokens=False)) for prompt in prompts]
        return asyncio.run(bench_url(self.url, self.name, None, prompts, tokens, max_tokens=settings.max_tokens,
                                     concurrency=None, request_rate=rate, cancel_fraction=0.0, seed=settings.seed))

    def memory(self) -> tuple[int | None, int | None]:
        files = Path(self.model).glob("*.safetensors")
        return sum(file.stat().st_size for file in files) or None, None


def open_rung(rung: Rung, settings: LadderSettings, context: "RungContext", stack: ExitStack) -> RungServer:
    if rung.engine == "transformers":
        return TransformersRung(rung.model, settings, context.device)
    if rung.engine == "llmc":
        return LlmcRung(context.make_engine(rung.model, rung.speculative))
    from llmc.external.vllm_server import vllm_model

    return VllmRung(vllm_model(rung.model), context.vllm, context.max_num_seqs, context.log_folder / f"{rung.name}.log",
                    stack)


@dataclass(frozen=True)
class RungContext:
    """What the rungs share: how the CLI builds llmc's engine (model, speculative -> LLM), vLLM, where logs go."""
    make_engine: Callable[[str, str], object]
    max_num_seqs: int
    log_folder: Path
    device: str = "cpu"  # the transformers rung's (the llmc rungs' is in make_engine)
    vllm: str | None = None


def run_rung(rung: Rung, prompts: list[str], settings: LadderSettings, budget_s: float, context: RungContext,
             on_probe: Callable[[str], None]) -> RungResult:
    """One rung's goodput search within budget_s (its first probe always runs); errors end the rung alone."""
    result = RungResult(rung, budget_s=budget_s)
    if rung.missing:
        result.error = rung.missing
        return result
    started = time.monotonic()
    try:
        with ExitStack() as stack:
            server = open_rung(rung, settings, context, stack)
            # a burst of requests at once warms the rung up; the rate it completes them at is the first rate tried
            burst = server.probe(prompts[:WARM_UP_BURST], 1e6, settings)
            if not burst["completed"]:
                raise RuntimeError("the warm-up requests did not complete")
            start_rate = max(settings.limits.min_rate, burst["request_throughput"])

            def probe(rate: float) -> dict:
                requests = probe_requests(prompts, rate, settings)
                summary = server.probe(requests, rate, settings)
                on_probe(f"{rung.name}: {rate:.3g} req/s x {len(requests)}, TTFT p90 {summary['ttft'].get('p90_ms', 0):.0f} ms, "
                         f"TPOT p90 {summary['tpot'].get('p90_ms', 0):.1f} ms")
                return summary

            # the share bounds the load tests: loading the model and starting a server come before it
            found = find_goodput(probe, settings.slo, start_rate, settings.limits, time.monotonic() + budget_s)
            fill(result, found, server)
    except Exception as error:  # noqa: BLE001 - whatever fails in one rung (a server, a kernel) ends that rung alone
        result.error = f"{type(error).__name__}: {error}"
    result.seconds = time.monotonic() - started
    return result


def probe_requests(prompts: list[str], rate: float, settings: LadderSettings) -> list[str]:
    """A probe's requests: num_prompts, or as many as arrive in probe_seconds at the rate where that is more, so that
    a fast rung is held at its rate long enough for a queue to build (the prompts reused in order)."""
    count = max(settings.num_prompts, math.ceil(rate * settings.probe_seconds))
    return [prompts[index % len(prompts)] for index in range(count)]


def fill(result: RungResult, found: Goodput, server: RungServer) -> None:
    result.stopped_by = found.stopped_by
    result.probes = [{"rate": p.rate, "misses": p.misses, "ttft_p90_ms": p.summary["ttft"].get("p90_ms"),
                      "tpot_p90_ms": p.summary["tpot"].get("p90_ms"), "output_throughput": p.summary["output_throughput"]}
                     for p in found.probes]
    result.weights_bytes, result.kv_bytes = server.memory()
    result.goodput = found.rate
    result.goodput_is_lower_bound = bool(found.probes) and not any(probe.misses for probe in found.probes)
    if not found.rate and found.probes:
        result.lowest_missed = min(probe.rate for probe in found.probes)
    if found.at_rate is not None:
        at = found.at_rate
        result.goodput_tokens_s = at["output_throughput"]
        result.ttft_p50_ms, result.ttft_p90_ms = at["ttft"].get("p50_ms"), at["ttft"].get("p90_ms")
        result.tpot_p50_ms, result.tpot_p90_ms = at["tpot"].get("p50_ms"), at["tpot"].get("p90_ms")


def rung_quality(rungs: list[Rung], base: str, business: Path, items: int) -> dict[str, dict]:
    """Business recovery, agreement and KL of each rung's weights (and KV cache, emulated) against the base model, by
    `llmc eval`'s side-by-side comparison; the unquantized rungs are the base, the draft rung serves the FP8 KV
    artifact's tokens (drafts are verified greedily)."""
    from llmc.evals.config import BusinessEval, EvalConfig
    from llmc.evals.suite import EvalTarget, evaluate_side_by_side

    models = sorted({rung.model for rung in rungs if rung.model and rung.model != base})
    if not models:
        return {}
    targets = [EvalTarget("base", base)] + [EvalTarget(model, model) for model in models]
    report = evaluate_side_by_side(targets, EvalConfig(business=BusinessEval(dataset=str(business), limit=items)))
    measured = {model: report["targets"][model]["vs_baseline"] for model in models}
    reference = {"recovery": 1.0, "agreement": 1.0, "kl": 0.0}
    return {rung.name: measured.get(rung.model, reference) for rung in rungs if rung.model}

