"""Where a decode step of the llmc runtime spends its time: an in-process engine on an artifact, BATCH sequences
decoding together, the mean step time over STEPS steps, then torch.profiler's top operators of a few steps.

    python benchmarks/profile_decode.py ARTIFACT [--batch 1 16] [--steps 40] [--dtype bfloat16] [--top 15] [--compile] [--dense-weights]
        [--no-amx] [--no-dense-copy] [--max-eager-int4-rows N]
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

PROMPT = "Explain in a few paragraphs why the sky is blue, and what sunsets have to do with it."


def decode_steps(engine: LLM, batch: int, steps: int) -> float:
    """Seconds per step once every sequence decodes (their prefill is done first, outside the timing)."""
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for index in range(batch):
        engine.add_request(PROMPT, params, f"r{time.perf_counter_ns()}-{index}")
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - started) / steps
    while engine.has_unfinished():
        engine.step()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--compile", action="store_true", help="The decoder layers' pieces under torch.compile.")
    parser.add_argument("--dense-weights", action="store_true", help="Weight-only layers dequantized onto dense matmuls.")
    parser.add_argument("--no-amx", action="store_true", help="Int4 layers off AMX.")
    parser.add_argument("--no-dense-copy", action="store_true", help="Int4 layers without a bfloat16 copy for many-row steps.")
    parser.add_argument("--max-eager-int4-rows", type=int, default=EngineConfig().max_eager_int4_rows)
    args = parser.parse_args()
    engine = LLM(args.artifact, EngineConfig(dtype=getattr(torch, args.dtype), enable_prefix_caching=False,
                                                   compile=args.compile, dense_weights=args.dense_weights,
                                                   amx_int4=not args.no_amx, int4_dense_copy=not args.no_dense_copy,
                                                   max_eager_int4_rows=args.max_eager_int4_rows))
    if engine.runner.amx_s is not None:
        print(f"int4 matmuls compiled for AMX in {engine.runner.amx_s:.1f} s")
    if args.compile:
        print(f"compiled in {engine.runner.compile_s:.1f} s")
    decode_steps(engine, 1, 4)  # warm-up
    for batch in args.batch:
        step_s = decode_steps(engine, batch, args.steps)
        print(f"batch {batch}: {step_s * 1e3:.1f} ms/step, {batch / step_s:.1f} tok/s")
        if not args.top:
            continue
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            decode_steps(engine, batch, 8)
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
