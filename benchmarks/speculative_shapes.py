"""Draft shapes side by side at batch 1: for each (depth, tree nodes, min confidence), tokens per step, mean accepted
length and wall-clock speed-up against plain decoding of the same engine settings, all in one process and interleaved
prompt by prompt (each prompt decoded plain, then with every shape), so that a slow spell of the machine falls on
every shape alike. Greedy; each output is checked against plain decoding's. Prompts: MT-bench first turns by default.

    python benchmarks/speculative_shapes.py ARTIFACT [--draft DIR] [--prompts FILE] [--num-prompts 10] [--max-tokens 128]
        [--shape DEPTH:NODES:CONFIDENCE ...]
"""
import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from llmc.core.prompts import distinct_prompts
from llmc.evals.speculative import timed_generate
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.engine.engine_stats import SpeculativeStats
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
MT_BENCH = ROOT.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
SHAPES = ["4:7:0.3", "4:7:0", "5:16:0", "6:32:0", "6:60:0"]  # docs/benchmarks.md's table: the default, then wider trees


@dataclass
class ShapeRun:
    name: str
    engine: LLM
    seconds: float = 0.0
    num_identical: int = 0


def shape_settings(draft: Path, spec: str) -> dict:
    """EngineConfig's fields for drafting every step with draft in the shape DEPTH:NODES:CONFIDENCE."""
    depth, nodes, confidence = spec.split(":")
    return dict(speculative=draft, adaptive_speculation=False, num_speculative_tokens=int(depth),
                speculative_tree_nodes=int(nodes), speculative_min_confidence=float(confidence))


def shape_config(draft: Path, spec: str, **settings) -> EngineConfig:
    """An engine drafting every step with draft in the shape DEPTH:NODES:CONFIDENCE, without prefix caching."""
    return EngineConfig(enable_prefix_caching=False, **shape_settings(draft, spec), **settings)


def shape_engine(artifact: str, draft: Path, spec: str) -> ShapeRun:
    config = shape_config(draft, spec)
    nodes = f"{config.speculative_tree_nodes} nodes" if config.speculative_tree_nodes else "a chain"
    name = f"depth {config.num_speculative_tokens}, {nodes}, confidence >= {config.speculative_min_confidence}"
    return ShapeRun(name, LLM(artifact, config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--draft", type=Path, help="Draft folder (default: ARTIFACT/draft).")
    parser.add_argument("--prompts", type=Path, default=MT_BENCH)
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--shape", action="append", help=f"DEPTH:NODES:CONFIDENCE, repeatable (default: {' '.join(SHAPES)}).")
    args = parser.parse_args()
    draft = args.draft or Path(args.artifact) / "draft"
    plain = LLM(args.artifact, EngineConfig(enable_prefix_caching=False))
    runs = [shape_engine(args.artifact, draft, spec) for spec in args.shape or SHAPES]
    prompts = distinct_prompts(args.prompts, args.num_prompts, plain.tokenizer)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for engine in [plain] + [run.engine for run in runs]:  # warm-up
        engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))
    for run in runs:  # count from here: not the warm-up
        speculator = run.engine.runner.speculator
        speculator.stats = SpeculativeStats(speculator.num_tokens)
    plain_s = 0.0
    for prompt in prompts:
        (reference,), seconds = timed_generate(plain, [prompt], params)
        plain_s += seconds
        for run in runs:
            (token_ids,), seconds = timed_generate(run.engine, [prompt], params)
            run.seconds += seconds
            run.num_identical += token_ids == reference
    print(f"{len(prompts)} prompts of {args.prompts.name}, {args.max_tokens} tokens, greedy, batch 1, {torch.get_num_threads()} threads; "
          f"plain decoding {plain_s:.1f} s")
    print(f"{'shape':42s} {'tokens/step':>11s} {'accepted':>9s} {'nodes/step':>10s} {'speed-up':>9s} identical")
    for run in runs:
        stats = run.engine.runner.speculator.stats
        nodes = stats.num_draft_tokens / max(stats.num_steps, 1)
        speedup = f"x{plain_s / run.seconds:.2f}"
        print(f"{run.name:42s} {stats.tokens_per_step:11.2f} {stats.mean_accepted_length:9.2f} {nodes:10.2f} {speedup:>9s} "
              f"{run.num_identical}/{len(prompts)}")


if __name__ == "__main__":
    main()
