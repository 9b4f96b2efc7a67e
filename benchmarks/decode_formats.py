"""Decode speed of the weight formats on llmc's runtime: SmolLM2-135M-Instruct quantized by round-to-nearest into
each preset, then, in one process and one after another, the mean decode step of each artifact at each batch size
(every sequence past its prefill, greedy, --steps steps), beside the same weights dequantized once onto dense
matmuls (`--dense-weights`, what serving the format without its kernel costs) and the unquantized model.

    python benchmarks/decode_formats.py [--presets NVFP4A16 MXFP4A16 W4A16] [--batch 1 16] [--steps 40]
        [--dtype bfloat16] [--rounds 2]
"""
import argparse
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from profile_decode import decode_steps

from llmc.checkpoints.spec import resolve_model
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.llm import LLM

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"


def machine() -> str:
    """The CPU's model name and the vector extensions that decide which kernels run."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), platform.machine())
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    vector = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if flag in flags]
    return f"{name} ({', '.join(vector) or 'no AVX2'}), {torch.get_num_threads()} threads"


def quantize(folder: Path, preset: str) -> Path:
    weights = "    weights: {group_size: 64}\n" if preset.startswith("W") else ""  # 128 does not divide 576
    recipe = folder / f"{preset}.yaml"
    recipe.write_text(f"model: {MODEL}\noutput: {folder / preset}\nstages:\n  - type: rtn\n    scheme: {preset}\n{weights}")
    subprocess.run([sys.executable, "-m", "llmc", "quantize", str(recipe)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return folder / preset


def step_seconds(folder: Path, dense: bool, dtype: torch.dtype, batches: list[int], steps: int) -> dict[int, float]:
    engine = LLM(str(folder), EngineConfig(dtype=dtype, enable_prefix_caching=False, dense_weights=dense))
    decode_steps(engine, 1, 4)  # warm-up
    return {batch: decode_steps(engine, batch, steps) for batch in batches}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", nargs="+", default=["NVFP4A16", "MXFP4A16", "W4A16"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--rounds", type=int, default=2, help="Every configuration is timed this often, interleaved; "
                                                               "the fastest round counts.")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as scratch:
        runs = {"unquantized": (resolve_model(MODEL), False)}
        for preset in args.presets:
            folder = quantize(Path(scratch), preset)
            runs[preset] = (folder, False)
            runs[f"{preset}, dequantized once (--dense-weights)"] = (folder, True)
        best: dict[str, dict[int, float]] = {}
        for _ in range(args.rounds):
            for name, (folder, dense) in runs.items():
                timed = step_seconds(folder, dense, dtype, args.batch, args.steps)
                best[name] = {batch: min(seconds, best.get(name, {}).get(batch, seconds)) for batch, seconds in timed.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    print(f"\n### Decode, {args.dtype}, SmolLM2-135M RTN: {machine()}, torch {torch.__version__}, commit {commit}, "
          f"{time.strftime('%Y-%m-%d')}")
    print(f"`python benchmarks/decode_formats.py {' '.join(sys.argv[1:])}`\n")
    print("| weights | " + " | ".join(f"batch {batch}: ms/step | tok/s" for batch in args.batch) + " |")
    print("|---|" + "---|---|" * len(args.batch))
    for name, seconds in best.items():
        cells = " | ".join(f"{seconds[batch] * 1e3:.1f} | {batch / seconds[batch]:.0f}" for batch in args.batch)
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
