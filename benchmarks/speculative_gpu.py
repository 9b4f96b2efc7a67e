"""What an EAGLE-3 draft would buy at batch 1 on a model too large to train a draft for here: step costs on random
weights in Llama-3-8B's shape (benchmarks/gpu_bench.py's), with a random EAGLE-3 draft of that shape (EAGLE-3's aux
layers, a 32,000-token draft vocabulary as EAGLE-3's Llama-3 heads use), combined with acceptances measured elsewhere.
Random weights accept nothing, and a shape of confidence 0 drafts and verifies every node whatever the draft guesses,
so a speculative step here costs what it costs with a trained head (a tree of confidence > 0 may verify fewer
nodes: its cost here is the most it costs). A step emits the accepted length L in tokens (accepted drafts plus the
target's own), so with drafts decoding runs L x (plain step) / (speculative step) times as fast; the table gives
that at each --accepted L, and the L at which drafting breaks even and doubles the speed.

    python benchmarks/speculative_gpu.py                      # on the GPU (benchmarks/gpu_check.sh)
    python benchmarks/speculative_gpu.py --device cpu --smoke  # the same code path, SmolLM2-shaped and tiny, on CPU
"""
import argparse
import tempfile
import traceback
from pathlib import Path

import torch
from gpu_bench import FORMATS, MODELS, Sizes, build_engine, model_config, timed_decode
from speculative_shapes import shape_settings
from transformers import LlamaConfig

from llmc.runtime.llm import LLM
from llmc.runtime.speculative.eagle3 import Eagle3Draft, default_aux_layers, eagle3_config
from llmc.runtime.speculative.store import save_draft, save_heads

DRAFT_VOCAB_SIZE = {"Llama-3-8B": 32000, "SmolLM2-135M": 8192}
SHAPES = ["3:0:0", "4:7:0"]  # a chain of 3 (the field's 3 steps, top-1), and the runtime's default tree drafted whole
# mean accepted lengths on MT-bench: llmc's EAGLE-3 on SmolLM2 W4A16 (chain of 3, then the default shape, all 80
# first turns: docs/speculative.md) and EAGLE-3's for Llama-3.1-8B at 3 steps, top-1 (SpecForge's SpecBundle)
ACCEPTED = [2.11, 2.36, 2.90]


def random_eagle3_draft(target: LlamaConfig, draft_vocab_size: int, folder: Path) -> Path:
    """An EAGLE-3 draft of random weights for target, over a random draft vocabulary, in llmc's draft folder layout."""
    config = eagle3_config(target, default_aux_layers(target.num_hidden_layers), draft_vocab_size)
    torch.manual_seed(0)
    draft = Eagle3Draft(config)
    generator = torch.Generator().manual_seed(0)
    draft.set_vocab(torch.randperm(target.vocab_size, generator=generator)[:draft_vocab_size].sort().values)
    save_heads(folder, draft)
    save_draft(folder, {"method": "eagle3", "hidden_size": target.hidden_size,
                        "aux_layer_ids": config.eagle_aux_hidden_state_layer_ids, "config": config.to_dict()})
    return folder


def step_cost(engine: LLM, sizes: Sizes) -> tuple[float, float]:
    """(milliseconds per decode step, tokens per step) of one greedy request at batch 1 (gpu_bench.timed_decode)."""
    seconds, num_steps, seq = timed_decode(engine, sizes)
    return 1000 * seconds / num_steps, (seq.num_output_tokens - 1) / num_steps


def measured_engines(model: str, fmt: str, sizes: Sizes, dtype: torch.dtype, device: str, shapes: list[str],
                     draft: Path) -> dict[str, tuple[float, float] | str]:
    """Each engine's step_cost, or the last line of its error: plain decoding as served (CUDA graphs where they
    apply) and eager, then each shape (speculative steps run eagerly)."""
    engines = {"plain": (False, {}), "plain, eager": (True, {})}
    engines |= {f"draft {spec}": (False, shape_settings(draft, spec)) for spec in shapes}
    costs = {}
    for name, (enforce_eager, settings) in engines.items():
        try:
            costs[name] = step_cost(build_engine(model, FORMATS[fmt], sizes, dtype, device, enforce_eager, **settings), sizes)
        except Exception:
            traceback.print_exc()
            costs[name] = traceback.format_exc().strip().splitlines()[-1][:100]
        if device.startswith("cuda"):  # the engine is gone: its memory goes back before the next one
            torch.cuda.empty_cache()
        print(f"{name}: {costs[name]}", flush=True)
    return costs


def print_table(costs: dict[str, tuple[float, float] | str], accepted: list[float]) -> None:
    plain = costs["plain"]
    at = " / ".join(f"{length:.2f}" for length in accepted)
    print(f"{'engine':18s} {'ms/step':>8s} {'tokens/step':>11s} {'x plain':>8s} {'L for x1 / x2':>14s}   speed-up at L = {at}")
    for name, cost in costs.items():
        if isinstance(cost, str):
            print(f"{name:18s} error: {cost}")
            continue
        ms, tokens = cost
        line = f"{name:18s} {ms:8.2f} {tokens:11.2f}"
        if not isinstance(plain, str):
            ratio = ms / plain[0]
            line += f" {ratio:8.2f}"
            if name.startswith("draft"):
                line += f" {ratio:6.2f} / {2 * ratio:5.2f}   " + " / ".join(f"x{length / ratio:.2f}" for length in accepted)
        print(line)

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="SmolLM2 shapes with 2 layers and a few tokens")
    parser.add_argument("--model", default="Llama-3-8B", choices=list(MODELS))
    parser.add_argument("--format", default="W4A16", choices=list(FORMATS))
    parser.add_argument("--shape", action="append", help=f"DEPTH:NODES:CONFIDENCE, repeatable (default: {' '.join(SHAPES)}).")
    parser.add_argument("--accepted", type=float, nargs="+", default=ACCEPTED,
                        help="mean accepted lengths (tokens per step) to combine with the step costs")
    args = parser.parse_args()
    if args.smoke:
        model, sizes = "SmolLM2-135M", Sizes(layers=2, prompt_len=8, new_tokens=12, concurrency=1)
    else:
        model, sizes = args.model, Sizes(layers=None, prompt_len=128, new_tokens=128, concurrency=1)
    dtype = torch.float16
    print(f"{model} {args.format}, random weights and a random EAGLE-3 draft, batch 1, {sizes.prompt_len}-token prompt, "
          f"{sizes.new_tokens} tokens, {torch.cuda.get_device_name() if args.device.startswith('cuda') else args.device}")
    with tempfile.TemporaryDirectory() as scratch:
        draft = random_eagle3_draft(model_config(model, sizes), DRAFT_VOCAB_SIZE[model], Path(scratch))
        costs = measured_engines(model, args.format, sizes, dtype, args.device, args.shape or SHAPES, draft)
    print()
    print_table(costs, args.accepted)


if __name__ == "__main__":
    main()
