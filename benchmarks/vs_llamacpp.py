"""`llmc serve` against llama.cpp's `llama-server` on the same model, one server at a time, driven by the same client
as benchmarks/vs_vllm.py (the `openai` async client streaming chat completions of MT-bench first turns, greedy,
`max_tokens` with `ignore_eos`). llama.cpp is built once from the pinned llama-cpp-python sdist
(../shared/peers/llamacpp.sh); its GGUFs are made here from the unquantized checkpoint with its own
convert_hf_to_gguf.py and llama-quantize (Q4_0, Q4_K_M), so neither side rests on a requantized file. llmc serves the
same checkpoint quantized W4A16 with its LM head in int8 (recipes/smollm2-w4a16-lm-head.yaml) and, for reference, the
quick start's W4A16 with a bfloat16 head. Prints one table: tok/s, TTFT and TPOT at each concurrency, each server's
bytes read per token (weights + KV cache at the mean context), the batch-1 step's read bandwidth beside this
machine's (a STREAM-like copy and read of 256 MiB), and llmc's ratios to llama.cpp Q4_0.

    python benchmarks/vs_llamacpp.py [--concurrency 1 16 64] [--llamacpp DIR] [--json out.json]
    python benchmarks/vs_llamacpp.py --random-shape llama3-8b --layers 2 --concurrency 1 16

--random-shape serves random weights in a real model's layer shapes (benchmarks/vs_vllm.py's), quantized by both.
"""
import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from vs_vllm import MODEL_NAME, MT_BENCH, RANDOM_SHAPES, drive, random_checkpoint, random_shape_artifact

from llmc.external.server_process import served

ROOT = Path(__file__).resolve().parents[1]
PEER_SCRIPT = ROOT.parent / "shared" / "peers" / "llamacpp.sh"
OUT = ROOT / "artifacts" / "llamacpp"
LLMC_RECIPES = {"llmc W4A16, int8 LM head": "smollm2-w4a16-lm-head.yaml", "llmc W4A16, bf16 LM head": "smollm2-w4a16-rtn.yaml"}
GGUF_TYPES = ("Q4_0", "Q4_K_M")
# requests a concurrency sends: at batch 1 enough that one slow request (a server's hiccup) moves the mean little
PROMPTS_PER_CONCURRENCY = {1: 16, 16: 32, 64: 128}
RANDOM_RECIPE = ("stages:\n  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 128}\n"
                 "lm_head:\n  scheme: W8A16\n")


def llamacpp_bin(folder: Path) -> Path:
    """llama.cpp's bin folder, built once by the peer script (about 10 minutes on 2 cores)."""
    done = subprocess.run(["bash", str(PEER_SCRIPT), str(folder)], check=True, capture_output=True, text=True)
    return Path(done.stdout.strip().splitlines()[-1])


def ggufs(checkpoint: Path, bin_dir: Path, name: str) -> dict[str, Path]:
    """Q4_0 and Q4_K_M GGUFs of the checkpoint: llama.cpp's converter to bfloat16 (sentencepiece, which it imports,
    installed once beside it, not into llmc's venv), then llama-quantize."""
    source = bin_dir.parents[1]
    deps = OUT / "convert-deps"
    if not (deps / "sentencepiece").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(deps), "sentencepiece"], check=True)
    bf16 = OUT / f"{name}-bf16.gguf"
    if not bf16.is_file():
        env = os.environ | {"PYTHONPATH": f"{source / 'gguf-py'}:{deps}"}
        subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", "bf16",
                        "--outfile", str(bf16)], check=True, env=env, capture_output=True)
    files = {}
    for kind in GGUF_TYPES:
        files[kind] = OUT / f"{name}-{kind}.gguf"
        if not files[kind].is_file():
            subprocess.run([str(bin_dir / "llama-quantize"), str(bf16), str(files[kind]), kind], check=True, capture_output=True)
    return files


def gguf_bytes_per_token(path: Path, bin_dir: Path) -> int:
    """Every tensor's bytes; the token embedding only where it is also the output matrix (tied), else one row."""
    sys.path.insert(0, str(bin_dir.parents[1] / "gguf-py"))
    from gguf import GGUFReader

    tensors = {tensor.name: int(tensor.n_bytes) for tensor in GGUFReader(path).tensors}
    if "output.weight" in tensors:
        tensors["token_embd.weight"] = 0
    return sum(tensors.values())


STORED_BYTES = {"I64": 8, "I32": 4, "F32": 4, "BF16": 2, "F16": 2, "U8": 1, "I8": 1, "F8_E4M3": 1}
QUANTIZED_PARAMS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_global_scale")


def llmc_bytes_per_token(artifact: Path) -> int:
    """The tensors a decode step reads as the runtime holds them: packed codes and float32 scales as stored, a
    bfloat16 LM head where it is tied to the embedding table (else the table is read a row at a time), other float
    tensors in bfloat16."""
    tied = json.loads((artifact / "config.json").read_text()).get("tie_word_embeddings", False)
    total = 0
    for file in artifact.glob("*.safetensors"):
        with safe_open(file, "pt") as tensors:
            for name in tensors.keys():
                view = tensors.get_slice(name)
                count = int(torch.tensor(view.get_shape()).prod())
                if "embed_tokens" in name:
                    total += 2 * count if tied else 0
                else:
                    total += count * (STORED_BYTES[view.get_dtype()] if name.endswith(QUANTIZED_PARAMS) else 2)
    return total


def kv_bytes_per_token(config: dict, context: float) -> float:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * context


def stream_bandwidth() -> dict[str, float]:
    """GB/s of a 256 MiB copy (read + write) and sum (read) on every core torch uses: the floor a decode step reads at."""
    source = torch.rand(64 * 2**20)
    target = torch.empty_like(source)
    rates = {}
    for name, run, moved in [("copy", lambda: target.copy_(source), 2 * source.nbytes), ("read", lambda: source.sum(), source.nbytes)]:
        run()
        started = time.perf_counter()
        for _ in range(10):
            run()
        rates[name] = moved * 10 / (time.perf_counter() - started) / 1e9
    return rates


def mean_context(tokenizer_folder: Path, prompts: list[str], max_tokens: int) -> float:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False) for p in prompts]
    lengths = [len(tokenizer(text, add_special_tokens=False).input_ids) for text in texts]
    return sum(lengths) / len(lengths) + max_tokens / 2


def server(kind: str, model: Path, port: int, bin_dir: Path, parallel: int) -> list[str]:
    if kind == "llama.cpp":
        return [str(bin_dir / "llama-server"), "-m", str(model), "--port", str(port), "--alias", MODEL_NAME, "-t", str(os.cpu_count()),
                "-np", str(parallel), "-c", str(parallel * 1024)]
    return [sys.executable, "-m", "llmc", "serve", str(model), "--port", str(port), "--served-model-name", MODEL_NAME,
            "--speculative", "off", "--max-num-seqs", str(max(parallel, 16))]


def measure(kind: str, model: Path, args, bin_dir: Path, prompts: list[str]) -> dict:
    parallel = max(args.concurrency)
    log = OUT / f"{kind.split()[0]}-{model.stem}.log"
    started = time.perf_counter()
    with served(kind, server(kind.split()[0], model, args.port, bin_dir, parallel), dict(os.environ), log,
                f"http://127.0.0.1:{args.port}/v1/models", 900):
        runs = {"startup_s": time.perf_counter() - started}
        for concurrency in args.concurrency:
            count = PROMPTS_PER_CONCURRENCY.get(concurrency, 2 * concurrency)
            chosen = [prompts[index % len(prompts)] for index in range(count)]
            runs[concurrency] = asyncio.run(drive(args.port, chosen, args.max_tokens, concurrency))
            print(f"  {kind:28} c={concurrency:<3} {runs[concurrency]['output_throughput']:7.1f} tok/s "
                  f"TPOT p50 {runs[concurrency]['tpot']['p50_ms']:.1f} ms", flush=True)
        return runs


def table(results: dict, concurrencies: list[int], stream: dict, baseline: str) -> str:
    lines = [f"machine stream bandwidth: copy {stream['copy']:.1f} GB/s, read {stream['read']:.1f} GB/s",
             f"{'server':30} {'MB/token':>9} {'b1 GB/s':>8} "
             + " ".join(f"{'c=' + str(c) + ' tok/s TTFT p50 TPOT p50':>34}" for c in concurrencies)]
    for kind, result in results.items():
        first = result["runs"][concurrencies[0]]
        rate = result["bytes_per_token"] / (first["tpot"]["p50_ms"] / 1e3) / 1e9
        cells = [f"{result['runs'][c]['output_throughput']:7.1f} {result['runs'][c]['ttft']['p50_ms']:8.0f} ms "
                 f"{result['runs'][c]['tpot']['p50_ms']:6.1f} ms" for c in concurrencies]
        lines.append(f"{kind:30} {result['bytes_per_token'] / 1e6:9.1f} {rate:8.1f} " + " ".join(f"{cell:>34}" for cell in cells))
    for kind, result in results.items():
        if kind.startswith("llmc") and baseline in results:
            ratios = [f"x{result['runs'][c]['output_throughput'] / results[baseline]['runs'][c]['output_throughput']:.2f} tok/s, "
                      f"TTFT x{results[baseline]['runs'][c]['ttft']['p50_ms'] / result['runs'][c]['ttft']['p50_ms']:.2f}"
                      for c in concurrencies]
            lines.append(f"{kind + ' / ' + baseline:>42} " + " ".join(f"{ratio:>34}" for ratio in ratios))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llamacpp", type=Path, default=ROOT.parent / "llamacpp", help="Where llama.cpp is (or gets) built.")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--random-shape", choices=list(RANDOM_SHAPES), help="Random weights in this model's shapes.")
    parser.add_argument("--layers", type=int, default=2, help="Decoder layers of a --random-shape model.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8472)
    parser.add_argument("--json", type=Path, help="Write every measurement here.")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    bin_dir = llamacpp_bin(args.llamacpp)
    prompts = [json.loads(line)["turns"][0] for line in MT_BENCH.read_text().splitlines() if line.strip()]
    from llmc.checkpoints.spec import resolve_model

    if args.random_shape:
        checkpoint = random_checkpoint(args.random_shape, args.layers)
        artifact = random_shape_artifact(args.random_shape, args.layers, RANDOM_RECIPE, "-lm-head")
        llmc_models = {"llmc W4A16 g128, int8 LM head": artifact}
        name = f"random-{args.random_shape}-{args.layers}l"
    else:
        checkpoint = resolve_model("smollm2-135m")
        llmc_models = {}
        for kind, recipe in LLMC_RECIPES.items():
            output = ROOT / "artifacts" / f"bench-{Path(recipe).stem}"
            if not (output / "llmc.json").is_file():
                subprocess.run([sys.executable, "-m", "llmc", "quantize", str(ROOT / "recipes" / recipe), "--output", str(output),
                                "--overwrite"], check=True)
            llmc_models[kind] = output
        name = "smollm2"
    servers = {f"llama.cpp {kind}": path for kind, path in ggufs(checkpoint, bin_dir, name).items()} | llmc_models
    config = json.loads((checkpoint / "config.json").read_text())
    context = mean_context(checkpoint, prompts, args.max_tokens)
    stream = stream_bandwidth()
    results = {}
    for kind, model in servers.items():
        weights = gguf_bytes_per_token(model, bin_dir) if kind.startswith("llama.cpp") else llmc_bytes_per_token(model)
        try:
            runs = measure(kind, model, args, bin_dir, prompts)
        except RuntimeError as error:
            print(f"  {kind} did not serve: {error}", flush=True)
            continue
        results[kind] = {"model": str(model), "weights_bytes_per_token": weights,
                         "bytes_per_token": weights + kv_bytes_per_token(config, context), "runs": runs}
    print(f"\nmean context {context:.0f} tokens; bytes per token = weights + KV cache (bf16/f16) at that context")
    print(table(results, args.concurrency, stream, "llama.cpp Q4_0"), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"stream": stream, "results": results}, indent=2))


if __name__ == "__main__":
    main()
