"""`llmc serve` against `vllm serve` on the same artifact, one server at a time, driven by the same client: the
official `openai` async client streaming chat completions of MT-bench first turns, greedy, `max_tokens` with
`ignore_eos` so that every server writes the same number of tokens. vLLM runs twice: with its defaults, and with
every core given to its model worker (VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU=0), its best here.
Prints one table per artifact with llmc's ratio to vLLM's better setting.

    python benchmarks/vs_vllm.py --vllm .vllm-venv [--formats w4a16 w8a8 fp8] [--concurrency 1 16 64]
    (the venv: benchmarks/vllm_venv.sh; artifacts are quantized once into artifacts/ with the shipped recipes)
    python benchmarks/vs_vllm.py --vllm .vllm-venv --random-shape qwen3-8b qwen3-30b-a3b [--layers 2]

--random-shape serves, instead of SmolLM2, random weights in a real model's layer shapes (a few layers; SmolLM2's
tokenizer and vocabulary, so the LM head is SmolLM2's size), built here and quantized W4A16 (RTN, g128).
"""
import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from openai import AsyncOpenAI

from llmc.bench.load import RequestResult, measure, summarize
from llmc.external.server_process import served

ROOT = Path(__file__).resolve().parents[1]
MT_BENCH = ROOT.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
RECIPES = {"w4a16": "smollm2-w4a16-rtn.yaml", "w8a8": "smollm2-w8a8-smoothquant.yaml", "fp8": "smollm2-fp8-dynamic.yaml"}
PROMPTS_PER_CONCURRENCY = {1: 6, 16: 32, 64: 128}
# real models' layer shapes (their config.json), for --random-shape
RANDOM_SHAPES = {
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, rope_theta=500000.0),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rope_theta=1000000.0),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True, rope_theta=1000000.0),
}
RANDOM_W4A16 = "stages:\n  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 128}\n"
MODEL_NAME = "model"  # what both servers are told to call the artifact
KV_CACHE_GIB = 1  # vLLM's CPU KV cache; without it vLLM reserves 92% of the NUMA node's memory and may refuse to start


def artifact(format_name: str) -> Path:
    """The shipped recipe's artifact, quantized once into artifacts/bench-FORMAT."""
    output = ROOT / "artifacts" / f"bench-{format_name}"
    if not (output / "llmc.json").is_file():
        subprocess.run([sys.executable, "-m", "llmc", "quantize", str(ROOT / "recipes" / RECIPES[format_name]),
                        "--output", str(output), "--overwrite"], check=True)
    return output


def random_checkpoint(shape: str, num_layers: int) -> Path:
    """Random bfloat16 weights in the shape's layers (std 0.02, as transformers initialises them), with SmolLM2's
    tokenizer, written once into artifacts/bench-random-SHAPE-NL-checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from llmc.checkpoints.spec import resolve_model

    checkpoint = ROOT / "artifacts" / f"bench-random-{shape}-{num_layers}l-checkpoint"
    if (checkpoint / "config.json").is_file():
        return checkpoint
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    fields = dict(RANDOM_SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), vocab_size=len(tokenizer), num_hidden_layers=num_layers,
                                  max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                                  **fields)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    return checkpoint


def random_shape_artifact(shape: str, num_layers: int, stages: str = RANDOM_W4A16, suffix: str = "") -> Path:
    """random_checkpoint quantized by `stages` (a recipe's stages section, and more) once into
    artifacts/bench-random-SHAPE-NL{suffix}."""
    output = ROOT / "artifacts" / f"bench-random-{shape}-{num_layers}l{suffix}"
    if (output / "llmc.json").is_file():
        return output
    recipe = output.with_name(output.name + ".yaml")
    recipe.write_text(f"model: {random_checkpoint(shape, num_layers)}\noutput: {output}\n{stages}")
    subprocess.run([sys.executable, "-m", "llmc", "quantize", str(recipe), "--overwrite"], check=True)
    return output


def server_command(kind: str, model: Path, port: int, vllm: Path, llmc_args: list[str]) -> tuple[list[str], dict]:
    if kind == "llmc":
        return [sys.executable, "-m", "llmc", "serve", str(model), "--port", str(port), "--served-model-name", MODEL_NAME,
                "--speculative", "off", *llmc_args], {}
    command = [str(vllm / "bin" / "vllm"), "serve", str(model), "--port", str(port), "--served-model-name", MODEL_NAME,
               "--dtype", "bfloat16", "--max-model-len", "2048"]
    kv_cache = {"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}  # what llmc's engine takes by default
    if kind == "vllm-all-cores":
        return command, kv_cache | {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return command, kv_cache


async def chat_stream(client: AsyncOpenAI, prompt: str, max_tokens: int):
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            yield 1


async def drive(port: int, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> RequestResult:
        async with gate:
            return await measure(chat_stream(client, prompt, max_tokens), RequestResult(0), None)

    try:
        await one(prompts[0])  # warm-up
        started = time.perf_counter()
        results = await asyncio.gather(*(one(prompt) for prompt in prompts))
        return summarize(list(results), time.perf_counter() - started)
    finally:
        await client.close()


def measure_server(kind: str, model: Path, port: int, vllm: Path, llmc_args: list[str], prompts: list[str], max_tokens: int,
                   concurrencies: list[int]) -> dict:
    command, extra_env = server_command(kind, model, port, vllm, llmc_args)
    log = ROOT / "artifacts" / f"vs-vllm-{kind}.log"
    started = time.perf_counter()
    with served(kind, command, os.environ | extra_env, log, f"http://127.0.0.1:{port}/v1/models", 600):
        startup_s = time.perf_counter() - started
        runs = {}
        for concurrency in concurrencies:
            count = PROMPTS_PER_CONCURRENCY.get(concurrency, 2 * concurrency)
            chosen = [prompts[index % len(prompts)] for index in range(count)]
            runs[concurrency] = asyncio.run(drive(port, chosen, max_tokens, concurrency))
            print(f"  {kind:15} c={concurrency:<3} {runs[concurrency]['output_throughput']:7.1f} tok/s", flush=True)
        return {"startup_s": startup_s, "runs": runs}


def table(format_name: str, results: dict, concurrencies: list[int]) -> str:
    best = {c: max(("vllm", "vllm-all-cores"), key=lambda kind: results[kind]["runs"][c]["output_throughput"]) for c in concurrencies}
    lines = [f"\n{format_name}: output tok/s, TTFT p50 / p99, TPOT p50 (ms); ratio = llmc / vLLM's better setting",
             f"{'server':16} {'start s':>7} " + " ".join(f"{'c=' + str(c):>30}" for c in concurrencies)]
    for kind, result in results.items():
        cells = []
        for c in concurrencies:
            run = result["runs"][c]
            cells.append(f"{run['output_throughput']:7.1f} {run['ttft']['p50_ms']:6.0f}/{run['ttft']['p99_ms']:6.0f} "
                         f"{run['tpot']['p50_ms']:6.1f}")
        lines.append(f"{kind:16} {result['startup_s']:7.0f} " + " ".join(f"{cell:>30}" for cell in cells))
    ratios = []
    for c in concurrencies:
        llmc, vllm = results["llmc"]["runs"][c], results[best[c]]["runs"][c]
        ratios.append(f"x{llmc['output_throughput'] / vllm['output_throughput']:.2f} tok/s, "
                      f"TTFT p50 x{vllm['ttft']['p50_ms'] / llmc['ttft']['p50_ms']:.2f}")
    lines.append(f"{'llmc / best vLLM':16} {'':7} " + " ".join(f"{ratio:>30}" for ratio in ratios))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm", type=Path, default=ROOT / ".vllm-venv", help="venv with vLLM (benchmarks/vllm_venv.sh)")
    parser.add_argument("--formats", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    parser.add_argument("--random-shape", nargs="+", choices=list(RANDOM_SHAPES), default=[],
                        help="Serve random W4A16 weights in these models' shapes instead of the SmolLM2 formats.")
    parser.add_argument("--layers", type=int, default=2, help="Decoder layers of a --random-shape model.")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--servers", nargs="+", choices=["llmc", "vllm", "vllm-all-cores"], default=["llmc", "vllm", "vllm-all-cores"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8471)
    parser.add_argument("--llmc-args", default="", help="More `llmc serve` options, e.g. \"--threads 1\".")
    parser.add_argument("--json", type=Path, help="Write every measurement here.")
    args = parser.parse_args()
    if "vllm" in " ".join(args.servers) and not (args.vllm / "bin" / "vllm").is_file():
        sys.exit(f"no vLLM in {args.vllm}: build it with benchmarks/vllm_venv.sh {args.vllm}")
    prompts = [json.loads(line)["turns"][0] for line in MT_BENCH.read_text().splitlines() if line.strip()]
    everything = {}
    models = {f"random {shape} x{args.layers} layers": lambda shape=shape: random_shape_artifact(shape, args.layers)
              for shape in args.random_shape}
    models = models or {format_name: lambda format_name=format_name: artifact(format_name) for format_name in args.formats}
    for format_name, build in models.items():
        model = build()
        print(f"{format_name}: {model}", flush=True)
        results = {}
        for kind in args.servers:
            try:
                results[kind] = measure_server(kind, model, args.port, args.vllm, args.llmc_args.split(), prompts, args.max_tokens,
                                               args.concurrency)
            except RuntimeError as error:  # a server that cannot serve the artifact (vLLM lacking a kernel for it here)
                print(f"  {kind:15} does not serve it: {error}", flush=True)
        everything[format_name] = results
        if {"llmc", "vllm", "vllm-all-cores"} <= set(results):
            print(table(format_name, results, args.concurrency), flush=True)
    if args.json:
        args.json.write_text(json.dumps(everything, indent=2))


if __name__ == "__main__":
    main()
