"""Speculative decoding measured against the same engine without it, in the same run: mean accepted length,
acceptance per position and wall-clock speed-up at batch 1 with drafts on every step (greedy, one request at a
time, the engines interleaved prompt by prompt: what the draft is worth), then as served (drafting only while it
measurably pays) at batch 1 and with `concurrency` requests in flight (the engines taking turns, a few rounds)."""
import time
from pathlib import Path

import torch
from rich.table import Table
from transformers import AutoTokenizer

from llmc.checkpoints.spec import resolve_model
from llmc.core.errors import LlmcError
from llmc.core.plot import saved_figure
from llmc.core.prompts import distinct_prompts
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.engine.engine_stats import SpeculativeStats
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.speculative.shape import COMPARISON_CHAIN
from llmc.runtime.speculative.store import draft_folder

CONCURRENCY_ROUNDS = 3  # the engines take turns, so that a slow spell of the machine falls on each of them


def timed_generate(engine: LLM, prompts: list[str], params: SamplingParams) -> tuple[list[list[int]], float]:
    started = time.perf_counter()
    outputs = engine.generate(prompts, params)
    return [output["token_ids"] for output in outputs], time.perf_counter() - started


def speculative_eval(model: str, draft: Path, prompts: list[str], max_tokens: int, concurrency: int, dtype: torch.dtype,
                     shape: dict | None = None, device: torch.device | str = "cpu") -> dict:
    """shape: EngineConfig's num_speculative_tokens, speculative_tree_nodes and speculative_min_confidence."""
    settings = dict(dtype=dtype, max_num_seqs=max(concurrency, 1), enable_prefix_caching=False, device=str(device))
    plain = LLM(model, EngineConfig(**settings))
    speculative = LLM(model, EngineConfig(**settings, speculative=draft, adaptive_speculation=False, **(shape or {})))
    served = LLM(model, EngineConfig(**settings, speculative=draft, **(shape or {})))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for engine in (plain, speculative, served):  # warm-up
        engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))
    speculator = speculative.runner.speculator
    stats = speculator.stats = SpeculativeStats(speculator.num_tokens)
    outputs = []
    plain_s = speculative_s = served_s = 0.0
    num_tokens = num_identical = 0
    for prompt in prompts:
        (plain_ids,), seconds = timed_generate(plain, [prompt], params)
        plain_s += seconds
        (speculative_ids,), seconds = timed_generate(speculative, [prompt], params)
        speculative_s += seconds
        (served_ids,), seconds = timed_generate(served, [prompt], params)
        served_s += seconds
        num_tokens += len(speculative_ids)
        num_identical += plain_ids == speculative_ids == served_ids
        outputs.append(speculative_ids)
    result = {
        "num_prompts": len(prompts), "max_tokens": max_tokens, "output_tokens": num_tokens, "outputs": outputs,
        "prompt_token_ids": [plain.tokenize(prompt) for prompt in prompts],
        "identical_outputs": num_identical,
        "mean_accepted_length": stats.mean_accepted_length,
        "tokens_per_step": stats.tokens_per_step,
        "acceptance_per_position": stats.acceptance_per_position,
        "accepted_length_histogram": dict(sorted(stats.accepted_lengths.items())),
        "batch1": {"plain_tokens_per_s": num_tokens / plain_s, "speculative_tokens_per_s": num_tokens / speculative_s,
                   "speedup": plain_s / speculative_s, "served_speedup": plain_s / served_s},
    }
    if concurrency > 1:
        seconds = {"plain": 0.0, "speculative": 0.0, "served": 0.0}
        for _ in range(CONCURRENCY_ROUNDS):
            for name, engine in (("plain", plain), ("speculative", speculative), ("served", served)):
                seconds[name] += timed_generate(engine, prompts, params)[1]
        result[f"concurrency{concurrency}"] = {
            "rounds": CONCURRENCY_ROUNDS, "plain_s": seconds["plain"], "speculative_s": seconds["speculative"],
            "speedup": seconds["plain"] / seconds["speculative"], "served_s": seconds["served"],
            "served_speedup": seconds["plain"] / seconds["served"],
        }
    return result


def plot_accepted_lengths(histogram: dict[int, int], path: Path, title: str) -> None:
    total = sum(histogram.values()) or 1
    with saved_figure(path, (5, 3.5)) as axis:
        axis.bar(list(histogram), [count / total for count in histogram.values()])
        axis.set(xlabel="tokens per verification step (accepted + 1)", ylabel="share of steps", title=title)


def vllm_chain(shape: dict) -> dict:
    """The shape both engines draft when compared: a chain (vLLM's EAGLE-3), every step, no confidence threshold."""
    if shape.get("speculative_tree_nodes") or shape.get("speculative_min_confidence"):
        raise LlmcError("--vllm compares chains: vLLM drafts --num-speculative-tokens tokens in a chain on every step, so "
                        "--speculative-tree-nodes and --speculative-min-confidence must be left out (or 0)")
    return {"num_speculative_tokens": shape.get("num_speculative_tokens") or COMPARISON_CHAIN, "speculative_tree_nodes": 0,
            "speculative_min_confidence": 0.0}


def evaluate_speculative(target: str, speculative: str, prompts_file: Path | None, num_prompts: int, max_tokens: int,
                         concurrency: int, histogram: Path | None, shape: dict, device: torch.device | str = "cpu",
                         vllm: str | None = None, vllm_args: tuple[str, ...] = ()) -> dict:
    """`llmc eval TARGET --speculative auto|DRAFT_DIR`: speculative_eval on the file's first distinct prompts (chat
    template, bfloat16), the accepted-length histogram drawn to `histogram` when given; with `vllm` (its venv or
    executable), the same draft measured in vLLM on the same prompt token ids, side by side, `vllm_args` added to
    each `vllm serve`."""
    if prompts_file is None:
        raise LlmcError("--speculative needs --prompts FILE (e.g. MT-bench question.jsonl)")
    draft = draft_folder(target, speculative)
    if draft is None:
        raise LlmcError(f"{target} has no draft heads; train them with `llmc train-draft {target}` or pass their folder")
    if vllm is not None:
        from llmc.evals.vllm_speculative import check_vllm_inputs

        check_vllm_inputs(draft, vllm)
        shape = vllm_chain(shape)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(target))
    prompts = distinct_prompts(prompts_file, num_prompts, tokenizer)
    result = speculative_eval(target, draft, prompts, max_tokens, concurrency, torch.bfloat16, shape, device)
    if histogram:
        plot_accepted_lengths(result["accepted_length_histogram"], histogram, f"{target}: accepted length")
    if vllm is not None:
        from llmc.evals.vllm_speculative import vllm_speculative_eval

        theirs = vllm_speculative_eval(target, draft, result["prompt_token_ids"], max_tokens, shape["num_speculative_tokens"], vllm,
                                       vllm_args)
        theirs["identical_to_llmc"] = sum(a == b for a, b in zip(theirs.pop("outputs"), result["outputs"]))
        theirs["accepted_length_ratio"] = theirs["mean_accepted_length"] / result["mean_accepted_length"]
        result["vllm"] = theirs
    del result["outputs"], result["prompt_token_ids"]
    return result | {"prompts": str(prompts_file), "concurrency": concurrency, "shape": shape}


def speculative_table(result: dict) -> Table:
    table = Table("metric", "value", title=f"speculative decoding, {result['num_prompts']} prompts of {result['prompts']}, greedy")
    table.add_row("mean accepted length", f"{result['mean_accepted_length']:.2f}")
    table.add_row("tokens per step, undrafted steps included", f"{result['tokens_per_step']:.2f}")
    table.add_row("acceptance per position", ", ".join(f"{value:.2f}" for value in result["acceptance_per_position"]))
    table.add_row("identical to plain decoding", f"{result['identical_outputs']} / {result['num_prompts']}")
    batch1 = result["batch1"]
    table.add_row("batch 1 tokens/s plain / speculative", f"{batch1['plain_tokens_per_s']:.1f} / {batch1['speculative_tokens_per_s']:.1f}")
    table.add_row("batch 1 speed-up, drafting every step / as served", f"x{batch1['speedup']:.2f} / x{batch1['served_speedup']:.2f}")
    loaded = result.get(f"concurrency{result['concurrency']}")
    if loaded:
        table.add_row(f"concurrency {result['concurrency']} speed-up, drafting every step / as served",
                      f"x{loaded['speedup']:.2f} / x{loaded['served_speedup']:.2f}")
    theirs = result.get("vllm")
    if theirs:
        table.add_row("vLLM: mean accepted length (vLLM / llmc)",
                      f"{theirs['mean_accepted_length']:.2f} (x{theirs['accepted_length_ratio']:.2f})")
        table.add_row("vLLM: acceptance per position", ", ".join(f"{value:.2f}" for value in theirs["acceptance_per_position"]))
        table.add_row("vLLM: identical to its plain decoding / to llmc's", f"{theirs['identical_to_plain']} / {theirs['identical_to_llmc']}"
                      f" of {result['num_prompts']}")
        batch1 = theirs["batch1"]
        table.add_row("vLLM: batch 1 tokens/s plain / speculative (speed-up)",
                      f"{batch1['plain_tokens_per_s']:.1f} / {batch1['speculative_tokens_per_s']:.1f} (x{batch1['speedup']:.2f})")
    return table
