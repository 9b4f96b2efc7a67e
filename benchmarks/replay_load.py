"""The served load of benchmarks/vs_vllm.py replayed in process, without HTTP: MT-bench first turns through the chat
template, greedy, max_tokens with ignore_eos, at most CONCURRENCY requests running, a new one admitted as one ends.
Prints output tok/s and the mean time of decode-only steps and of steps that also prefill.

    python benchmarks/replay_load.py ARTIFACT [--concurrency 16] [--requests 32] [--max-tokens 128] [--no-cpu-decode-kernel]
        [--no-int4-dense-copy]
"""
import argparse
import json
import time
from pathlib import Path

from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

MT_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench" / "question.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--no-cpu-decode-kernel", action="store_true", help="Decode attention on the torch reference.")
    parser.add_argument("--no-int4-dense-copy", action="store_true", help="Int4 layers on the int4 kernel for every step.")
    args = parser.parse_args()
    engine = LLM(args.artifact, EngineConfig(cpu_decode_kernel=not args.no_cpu_decode_kernel,
                                                   int4_dense_copy=not args.no_int4_dense_copy))
    questions = [json.loads(line)["turns"][0] for line in MT_BENCH.read_text().splitlines() if line.strip()]
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"] for question in questions]
    engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    pending = [list(prompts[index % len(prompts)]) for index in range(args.requests)]
    running, seconds, steps = 0, {"decode": 0.0, "prefill": 0.0}, {"decode": 0, "prefill": 0}
    started = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and running < args.concurrency:
            engine.add_request(pending.pop(0), params)
            running += 1
        prefilling = any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in [*engine.scheduler.running, *engine.scheduler.waiting])
        step_started = time.perf_counter()
        outputs = engine.step()
        kind = "prefill" if prefilling else "decode"
        seconds[kind] += time.perf_counter() - step_started
        steps[kind] += 1
        running -= sum(output.finish_reason is not None for output in outputs)
    elapsed = time.perf_counter() - started
    print(f"concurrency {args.concurrency}: {args.requests * args.max_tokens / elapsed:.1f} output tok/s in {elapsed:.1f} s; "
          + ", ".join(f"{kind} steps: {steps[kind]} x {seconds[kind] / steps[kind] * 1e3:.1f} ms" for kind in steps if steps[kind]))


if __name__ == "__main__":
    main()
