"""Decode speed of the llmc runtime per weight format, on random weights built directly in device memory in the
shapes of Llama-3-8B and SmolLM2-135M (nothing read from disk or the internet): batch-1 decode tokens/s with its
memory-bandwidth utilisation (bytes of weights and KV read per token x tokens/s / peak HBM bandwidth), and output
throughput at a concurrency of 64. Every (model, format) runs on its own, so one failure leaves the others.

    python benchmarks/gpu_bench.py                      # on the GPU (benchmarks/gpu_check.sh)
    python benchmarks/gpu_bench.py --device cpu --smoke  # the same code path, SmolLM2-shaped and tiny, on CPU
"""
import argparse
import json
import math
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, replace

import torch
from transformers import LlamaConfig

from llmc.core.integers import cdiv
from llmc.quant.qtypes import QuantArgs, QuantizedWeight
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.engine.model_runner import ModelRunner
from llmc.runtime.engine.sequence import Sequence
from llmc.runtime.layers.linear import build_linear
from llmc.runtime.layers.linear_weight import LinearWeight
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

MODELS = {
    "Llama-3-8B": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "SmolLM2-135M": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
}
PEAK_BANDWIDTH = [("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100", 2.0e12)]  # bytes/s, by device name
WEIGHT_STD = 0.02
MAX_RUN_S = 100  # one (model, format) on the GPU: building, capturing graphs, both measurements


@dataclass(frozen=True)
class Format:
    weights: QuantArgs | None  # None: dense weights in the compute dtype
    input_activations: QuantArgs | None = None
    input_scale: float | None = None  # static activation scale
    fp8_kv_cache: bool = False


FORMATS = {
    "fp16": Format(None),
    "W4A16": Format(QuantArgs(num_bits=4, group_size=128)),
    "W8A8": Format(QuantArgs(num_bits=8, strategy="channel"), QuantArgs(num_bits=8, strategy="token", dynamic=True)),
    "FP8": Format(
        QuantArgs(num_bits=8, type="float", strategy="channel"), QuantArgs(num_bits=8, type="float", strategy="token", dynamic=True),
    ),
    "FP8 per-tensor": Format(
        QuantArgs(num_bits=8, type="float", strategy="tensor"), QuantArgs(num_bits=8, type="float", strategy="tensor"), 0.01,
    ),
    "W4A16 + FP8 KV": Format(QuantArgs(num_bits=4, group_size=128), fp8_kv_cache=True),
}
KV_SCALE = 0.02  # random keys and values stay within a few units


def random_codes(shape: tuple[int, int], args: QuantArgs, device: str) -> tuple[torch.Tensor, float]:
    """Codes spread over the format's range, and the scale that gives dequantized weights about WEIGHT_STD."""
    if args.type == "float":
        return (torch.randn(shape, device=device) * 64).to(torch.float8_e4m3fn), WEIGHT_STD / 64
    qmax = int(args.qmax)
    return torch.randint(-qmax - 1, qmax + 1, shape, dtype=torch.int8, device=device), WEIGHT_STD / (qmax / 3**0.5)


class RandomWeights:
    """The WeightLoader interface over random tensors: Linears in one format (lm_head stays dense, as artifacts
    leave it), norms of ones."""

    def __init__(self, config: LlamaConfig, fmt: Format, dtype: torch.dtype, device: str):
        self.format, self.dtype, self.device = fmt, dtype, device
        self.kv_cache_dtype = torch.float8_e4m3fn if fmt.fp8_kv_cache else dtype
        # (targets, weight args, input-activation args), as an artifact's config groups read back
        self.schemes = [(["Linear"], fmt.weights, fmt.input_activations)] if fmt.weights is not None else []
        head_dim = config.hidden_size // config.num_attention_heads
        hidden, inter = config.hidden_size, config.intermediate_size
        self.shapes = {
            "q_proj": (config.num_attention_heads * head_dim, hidden), "k_proj": (config.num_key_value_heads * head_dim, hidden),
            "v_proj": (config.num_key_value_heads * head_dim, hidden), "o_proj": (hidden, config.num_attention_heads * head_dim),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter),
            "lm_head": (config.vocab_size, hidden), "embed_tokens": (config.vocab_size, hidden),
        }
        self.hidden = hidden
        self.group_size = math.gcd(128, hidden, inter)  # W4A16: the largest group up to 128 that divides every width

    def __contains__(self, name: str) -> bool:
        """Llama's tensors only (no q/k norms, no biases)."""
        module = name.removesuffix(".weight").split(".")[-1]
        return name.endswith(".weight") and (module in self.shapes or module.endswith("layernorm") or module == "norm")

    def tensor(self, name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(self.hidden, dtype=self.dtype, device=self.device)
        return torch.randn(self.shapes[name.split(".")[-2]], dtype=self.dtype, device=self.device) * WEIGHT_STD

    def kv_scales(self, prefix: str, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.format.fp8_kv_cache:
            return None
        return tuple(torch.full((num_kv_heads,), KV_SCALE, device=self.device) for _ in range(2))

    def kv_rounding(self, prefix: str) -> None:
        return None  # no NVFP4 KV cache among the benchmark's formats

    def linear(self, names: list[str]) -> torch.nn.Module:
        return build_linear([self._linear_weight(name) for name in names], self.dtype, self.device)

    def _linear_weight(self, name: str) -> LinearWeight:
        shape = self.shapes[name.split(".")[-1]]
        args = self.format.weights
        if args is not None and args.strategy == "group":
            args = replace(args, group_size=self.group_size)
        if args is None or name == "lm_head":
            return LinearWeight(torch.randn(shape, dtype=self.dtype, device=self.device) * WEIGHT_STD)
        codes, scale = random_codes(shape, args, self.device)
        if args.strategy == "group":  # group scales are stored in the model's dtype, the others in float32
            scales = torch.full((shape[0], shape[1] // args.group_size), scale, dtype=self.dtype, device=self.device)
        else:
            scales = torch.full((shape[0], 1) if args.strategy == "channel" else (1,), scale, device=self.device)
        weight = QuantizedWeight(codes, scales, torch.zeros_like(scales, dtype=torch.int8), args, None, self.format.input_activations)
        input_scale = None if self.format.input_scale is None else torch.tensor([self.format.input_scale], device=self.device)
        return LinearWeight(weight, None, input_scale)


class TokenIds:
    """The tokenizer an engine needs, for prompts given as token ids and outputs nobody reads."""

    eos_token_id = None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes every decode step reads: all weights but the embedding table (one row per token)."""
    seen, total = set(), 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.startswith("embed_tokens") or name.endswith(("rotary.cos", "rotary.sin")) or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def peak_bandwidth(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((peak for key, peak in PEAK_BANDWIDTH if key in name), None)


@dataclass
class Sizes:
    layers: int | None  # None: the model's own
    prompt_len: int
    new_tokens: int
    concurrency: int


def model_config(model: str, sizes: Sizes) -> LlamaConfig:
    return LlamaConfig(**MODELS[model] | ({"num_hidden_layers": sizes.layers} if sizes.layers else {}))


def build_engine(model: str, fmt: Format, sizes: Sizes, dtype: torch.dtype, device: str, enforce_eager: bool,
                 **settings) -> LLM:
    """An engine over random weights of model in fmt; settings: further EngineConfig fields (e.g. a draft)."""
    config = model_config(model, sizes)
    context = sizes.prompt_len + sizes.new_tokens
    engine_config = EngineConfig(
        dtype=dtype, device=device, max_num_seqs=sizes.concurrency, max_model_len=context + 16, max_num_batched_tokens=2048,
        num_kv_blocks=sizes.concurrency * (cdiv(context, 16) + 1), enable_prefix_caching=False, enforce_eager=enforce_eager,
        **settings,
    )
    torch.manual_seed(0)
    runner = ModelRunner(config, RandomWeights(config, fmt, dtype, device), engine_config)
    return LLM.from_runner(f"random {model}", runner, TokenIds(), engine_config)


def prompts(engine: LLM, count: int, length: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, engine.runner.hf_config.vocab_size, (count, length), generator=generator).tolist()


def timed_decode(engine: LLM, sizes: Sizes) -> tuple[float, int, Sequence]:
    """One greedy request at batch 1 after a warm-up: the seconds and engine steps of its decode (the prefill step,
    which emits the first token, left out), and the request."""
    params = SamplingParams(temperature=0, max_tokens=sizes.new_tokens, ignore_eos=True)
    # a warm-up long enough for drafts of full depth (benchmarks/speculative_gpu.py), so no first-use cost is timed
    engine.generate(prompts(engine, 1, sizes.prompt_len), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    seq = engine.add_request(prompts(engine, 1, sizes.prompt_len)[0], params)
    engine.step()  # prefill and the first token
    num_steps, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        num_steps += 1
    return time.perf_counter() - start, num_steps, seq


def batch1_decode(engine: LLM, sizes: Sizes) -> tuple[float, list[int]]:
    """Tokens/s of the decode steps alone and the tokens, for comparisons."""
    seconds, _, seq = timed_decode(engine, sizes)
    return (sizes.new_tokens - 1) / seconds, seq.output_token_ids


def throughput(engine: LLM, sizes: Sizes) -> float:
    """Output tokens/s with `concurrency` requests in flight from the start, prefills included."""
    params = SamplingParams(temperature=0, max_tokens=sizes.new_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.generate(prompts(engine, sizes.concurrency, sizes.prompt_len), params)
    return sizes.concurrency * sizes.new_tokens / (time.perf_counter() - start)


def kv_bytes_per_token(engine: LLM, sizes: Sizes) -> float:
    """K and V read by one decode step, at the mean context length of the batch-1 run."""
    _, layers, _, _, kv_heads, head_dim = engine.runner.kv_cache.shape
    mean_context = sizes.prompt_len + sizes.new_tokens / 2
    return 2 * layers * kv_heads * head_dim * engine.runner.kv_cache.element_size() * mean_context


def run(model: str, name: str, sizes: Sizes, dtype: torch.dtype, device: str, eager_check: bool) -> dict:
    engine = build_engine(model, FORMATS[name], sizes, dtype, device, enforce_eager=False)
    kernel = type(engine.runner.model.layers[0].self_attn.qkv_proj).__name__  # e.g. a fallback to DenseLinear
    row = {"model": model, "format": name, "kernel": kernel, "weights GB": weight_bytes(engine.runner.model) / 1e9}
    tokens_per_s, tokens = batch1_decode(engine, sizes)
    bytes_per_token = weight_bytes(engine.runner.model) + kv_bytes_per_token(engine, sizes)
    peak = peak_bandwidth(device)
    row |= {"batch-1 tok/s": tokens_per_s, "MBU": bytes_per_token * tokens_per_s / peak if peak else None}
    row[f"tok/s @ {sizes.concurrency}"] = throughput(engine, sizes)
    if eager_check and engine.runner.graphs is not None:
        del engine
        eager = build_engine(model, FORMATS[name], sizes, dtype, device, enforce_eager=True)
        eager_tokens_per_s, eager_tokens = batch1_decode(eager, sizes)
        # split-K atomics sum in any order, so a near-tie may flip late; the leading run of equal tokens shows agreement
        same = next((index for index, pair in enumerate(zip(tokens, eager_tokens)) if pair[0] != pair[1]), len(tokens))
        row["tokens = eager"] = f"{same}/{len(tokens)}"
        row["eager tok/s"] = eager_tokens_per_s
    return row


def print_table(rows: list[dict], flush: bool = False) -> None:
    columns = list(dict.fromkeys(key for row in rows for key in row))

    def cell(column: str, value) -> str:
        if value is None:
            return "n/a"
        if isinstance(value, float):
            return f"{value:.1%}" if column == "MBU" else f"{value:,.2f}"
        return str(value)

    cells = [[cell(column, row.get(column, "")) for column in columns] for row in rows]
    widths = [max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)]
    print("  ".join(column.ljust(width) for column, width in zip(columns, widths)))
    for line in cells:
        print("  ".join(value.ljust(width) for value, width in zip(line, widths)), flush=flush)


def run_isolated(model: str, name: str, args: argparse.Namespace, timeout: float) -> dict:
    """One (model, format) in its own process: a CUDA error poisons the process's context, and a hang is cut off."""
    command = [sys.executable, __file__, "--device", args.device, "--models", model, "--formats", name, "--json"]
    try:
        result = subprocess.run(command + ["--smoke"] * args.smoke, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "format": name, "error": f"not done within {timeout:.0f} s"}
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        print(result.stderr[-3000:], file=sys.stderr)
        return {"model": model, "format": name, "error": (result.stderr.strip().splitlines() or ["no output"])[-1][:100]}
    return json.loads(lines[-1])


def run_guarded(model: str, name: str, sizes: Sizes, dtype: torch.dtype, device: str) -> dict:
    try:
        return run(model, name, sizes, dtype, device, eager_check=name == "W4A16")
    except Exception:
        traceback.print_exc()
        return {"model": model, "format": name, "error": traceback.format_exc().strip().splitlines()[-1][:100]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="SmolLM2 shapes with 2 layers and a few tokens")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--budget-s", type=float, default=250.0, help="CUDA: formats not started within it are skipped")
    parser.add_argument("--json", action="store_true", help="run in this process and print the one row as JSON")
    args = parser.parse_args()
    if args.smoke:
        models, sizes, dtype = ["SmolLM2-135M"], Sizes(layers=2, prompt_len=8, new_tokens=4, concurrency=3), torch.float16
    else:
        models, sizes, dtype = args.models, Sizes(layers=None, prompt_len=128, new_tokens=128, concurrency=64), torch.float16
    device = args.device
    if args.json:
        print(json.dumps(run_guarded(models[0], args.formats[0], sizes, dtype, device)))
        return
    isolate = device.startswith("cuda")
    if isolate:
        print(f"{torch.cuda.get_device_name(torch.device(device))}, peak HBM bandwidth {peak_bandwidth(device) or 'unknown'} B/s")
    deadline = time.monotonic() + args.budget_s
    rows = []
    for model in models:
        for name in args.formats:
            left = deadline - time.monotonic()
            if isolate and left < 20:
                rows.append({"model": model, "format": name, "error": "skipped: time budget spent"})
            elif isolate:
                rows.append(run_isolated(model, name, args, min(left, MAX_RUN_S)))
            else:
                rows.append(run_guarded(model, name, sizes, dtype, device))
            print_table(rows[-1:], flush=True)
    print()
    print_table(rows)


if __name__ == "__main__":
    main()
