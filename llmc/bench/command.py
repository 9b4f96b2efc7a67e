"""`llmc bench`: a load test of an in-process engine or a running server, optionally beside transformers `generate`
on the same prompts in the same run, and the table of its results."""
import asyncio
from pathlib import Path

from rich.table import Table
from transformers import AutoTokenizer

from llmc.bench.hf_baseline import hf_baseline
from llmc.bench.load import PERCENTILES, bench_engine, bench_url
from llmc.checkpoints.spec import resolve_model
from llmc.core.prompts import load_prompts
from llmc.runtime.llm import LLM
from llmc.runtime.serving.async_engine import AsyncLLMEngine

RUNS = ("llmc", "hf")


def run_bench(model: str, dataset: Path, num_prompts: int, chat_template: bool, shared_prefix_tokens: int, load: dict,
              engine: LLM | None = None, url: str | None = None, api_key: str | None = None,
              baseline_num_prompts: int | None = None, baseline: bool = False) -> dict:
    """load: run_load's max_tokens, concurrency, request_rate, cancel_fraction and seed. Against `url` when given,
    else the in-process `engine`; with `baseline`, transformers on the first baseline_num_prompts prompts too."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    prompts = load_prompts(dataset, num_prompts, tokenizer, chat_template, shared_prefix_tokens)
    if url:
        prompt_tokens = [len(tokenizer.encode(prompt, add_special_tokens=False)) for prompt in prompts]
        results = {"llmc": asyncio.run(bench_url(url.rstrip("/"), model, api_key, prompts, prompt_tokens, **load))}
    else:
        results = {"llmc": asyncio.run(bench_engine(AsyncLLMEngine(engine, max_waiting=num_prompts), prompts, **load))}
    if baseline:
        results["hf"] = hf_baseline(model, prompts[:baseline_num_prompts], load["max_tokens"])
        results["speedup"] = {
            "output_throughput": results["llmc"]["output_throughput"] / results["hf"]["output_throughput"],
            "tpot_p50": results["hf"]["tpot"]["p50_ms"] / results["llmc"]["tpot"]["p50_ms"],
        }
    return results


def bench_table(results: dict) -> Table:
    runs = [name for name in RUNS if name in results]
    table = Table("metric", *runs, title="llmc bench")
    rows = [("completed / cancelled", lambda r: f"{r['completed']} / {r['cancelled']}"),
            ("output tokens/s", lambda r: f"{r['output_throughput']:.1f}"),
            ("requests/s", lambda r: f"{r['request_throughput']:.3f}")]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for p in PERCENTILES:
            rows.append((f"{metric.upper()} p{p} (ms)", lambda r, m=metric, p=p: f"{r[m].get(f'p{p}_ms', float('nan')):.1f}"))
    for label, cell in rows:
        table.add_row(label, *(cell(results[name]) for name in runs))
    return table


def bench_notes(results: dict) -> list[str]:
    """The lines printed under the table: the engine's KV and preemption counters, and the ratio to transformers."""
    extras = {k: v for k, v in results["llmc"].items() if k.startswith(("kv_", "leaked", "preempt", "ttft_first", "ttft_later"))}
    notes = [str(extras)] if extras else []
    if "speedup" in results:
        notes.append(f"llmc / hf: output throughput x{results['speedup']['output_throughput']:.2f}, "
                     f"TPOT p50 x{results['speedup']['tpot_p50']:.2f}")
    return notes
