"""Where a decode step's time goes, plain and speculative, at batch 1: the target's forward (all verified rows), its
LM head, preparing the step's metadata, drafting the next tree and verifying this one, in milliseconds per step,
for each draft shape. Drafting and verification cost the same whatever the draft guesses, so with shapes of confidence
0 (DEPTH:NODES:0, every node drafted) a draft of random weights (`--random-draft`) measures the cost of a tree of that size.

    python benchmarks/speculative_step_costs.py ARTIFACT [--draft DIR | --random-draft] [--shape DEPTH:NODES:CONFIDENCE ...]
        [--max-tokens 128] [--dense-weights]
"""
import argparse
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
from speculative_shapes import shape_config
from transformers import AutoConfig

from llmc.draft.build import eagle_shape
from llmc.draft.vocabulary import DRAFT_VOCAB_SIZE
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.engine.model_runner import ModelRunner
from llmc.runtime.llm import LLM
from llmc.runtime.models.llama import LlamaForCausalLM
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.speculative.decoder import SpeculativeDecoder
from llmc.runtime.speculative.eagle import EagleDraft
from llmc.runtime.speculative.proposers import EagleProposer, MedusaProposer
from llmc.runtime.speculative.store import save_draft, save_heads

PARTS = {  # (class, method) -> the part it times
    (ModelRunner, "run"): "whole step", (LlamaForCausalLM, "forward"): "target forward", (LlamaForCausalLM, "compute_logits"): "LM head",
    (ModelRunner, "_prepare"): "prepare", (EagleProposer, "propose"): "draft", (MedusaProposer, "propose"): "draft",
    (SpeculativeDecoder, "_verify"): "verify",
}
SHAPES = ["4:7:0", "5:16:0", "6:32:0", "6:60:0"]  # full trees, from the default's size to EAGLE-2's
PROMPT = "Write a persuasive essay about why cities should invest in public transport, with three arguments."


@contextmanager
def timed_parts(seconds: dict[str, float], calls: dict[str, int]):
    originals = {key: getattr(*key) for key in PARTS}

    def timing(method, part):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - started
                calls[part] += 1
        return timed

    for (cls, name), method in originals.items():
        setattr(cls, name, timing(method, PARTS[cls, name]))
    try:
        yield
    finally:
        for (cls, name), method in originals.items():
            setattr(cls, name, method)


def random_eagle_draft(artifact: Path, folder: Path) -> Path:
    """An EAGLE draft of random weights over a random draft vocabulary: what drafting costs, not what it guesses."""
    shape = eagle_shape(artifact, DRAFT_VOCAB_SIZE)
    draft = EagleDraft(shape)
    vocab_size = AutoConfig.from_pretrained(artifact).vocab_size
    draft.vocab.copy_(torch.randperm(vocab_size, generator=torch.Generator().manual_seed(0))[:DRAFT_VOCAB_SIZE].sort().values)
    save_heads(folder, draft)
    save_draft(folder, {"method": "eagle", "hidden_size": shape.hidden_size, "shape": asdict(shape)})
    return folder


def step_costs(artifact: Path, config: EngineConfig, prompt: str, max_tokens: int) -> tuple[int, int, dict[str, float]]:
    """(tokens, steps, milliseconds per step of each part) of one greedy request, after a warm-up."""
    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    with timed_parts(seconds, calls):  # from the engine's construction: the decoder keeps bound methods
        engine = LLM(artifact, config)
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        engine.generate([text], SamplingParams(temperature=0, max_tokens=8))
        seconds.clear()
        calls.clear()
        (output,) = engine.generate([text], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    num_steps = calls["whole step"]
    return len(output["token_ids"]), num_steps, {part: 1000 * value / num_steps for part, value in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--draft", type=Path, help="Draft folder (default: ARTIFACT/draft).")
    parser.add_argument("--random-draft", action="store_true", help="Measure an EAGLE draft of random weights (costs only).")
    parser.add_argument("--shape", action="append", help=f"DEPTH:NODES:CONFIDENCE, repeatable (default: {' '.join(SHAPES)}).")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dense-weights", action="store_true", help="Weight-only layers dequantized onto dense matmuls.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        draft = random_eagle_draft(args.artifact, Path(scratch)) if args.random_draft else args.draft or args.artifact / "draft"
        configs = {"plain": EngineConfig(enable_prefix_caching=False, dense_weights=args.dense_weights)}
        for spec in args.shape or SHAPES:
            configs[spec] = shape_config(draft, spec, dense_weights=args.dense_weights)
        parts = ["whole step", "target forward", "LM head", "draft", "verify", "prepare"]
        print(f"{args.artifact.name}, {torch.get_num_threads()} threads, {'dense weights' if args.dense_weights else 'serving kernels'}, "
              f"{'random' if args.random_draft else 'trained'} draft; milliseconds per step")
        print(f"{'shape':>10s} {'tokens/step':>11s} " + " ".join(f"{part:>14s}" for part in parts))
        for name, config in configs.items():
            num_tokens, num_steps, costs = step_costs(args.artifact, config, PROMPT, args.max_tokens)
            print(f"{name:>10s} {num_tokens / num_steps:11.2f} " + " ".join(f"{costs.get(part, 0.0):14.2f}" for part in parts))


if __name__ == "__main__":
    main()
