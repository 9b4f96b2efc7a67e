"""`llmc quantize` at Llama-3-8B's layer shapes: random weights (hidden 4096, intermediate 14336, 32 heads, 8 KV heads,
vocabulary 128,256; N layers, nothing downloaded), GPTQ W4A16 g128 and AWQ + RTN W4A16 g128, each in its own
process on the chosen device. Prints seconds per layer, the 32-layer extrapolation, peak host RSS and peak device
memory beside the memory preflight's estimate, and one layer's bf16 weights for scale.

    python benchmarks/scale.py [--layers 2] [--samples 128] [--seq-len 2048] [--device auto] [--only gptq]
    (on a 2-core CPU: --samples 8 --seq-len 512)
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = {
    "gptq": "  - type: gptq\n    scheme: W4A16\n",
    "awq+rtn": "  - type: awq\n  - type: rtn\n    scheme: W4A16\n",
}
LLM_COMPRESSOR_GPTQ_8B_S = 745  # Llama-3-8B GPTQ W4A16 on one GPU (its distributed-oneshot guide, ../shared/reference)
LLAMA_3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                  max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)


def make_checkpoint(folder: Path, num_layers: int) -> Path:
    code = f"""
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from llmc.checkpoints.spec import resolve_model
config = LlamaConfig(num_hidden_layers={num_layers}, **{LLAMA_3_8B!r})
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained("{folder}")
AutoTokenizer.from_pretrained(resolve_model("smollm2-135m")).save_pretrained("{folder}")
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    return folder


def calibration_text(folder: Path, num_tokens: int) -> Path:
    """The shipped eval text, repeated until it holds num_tokens (about four characters a token)."""
    text = (ROOT / "calib_data" / "smollm2_eval_text.txt").read_text()
    path = folder / "calibration.txt"
    path.write_text("\n\n".join([text] * (num_tokens * 5 // len(text) + 1)))
    return path


def run(model: Path, folder: Path, stage: str, calibration: Path, samples: int, seq_len: int, device: str) -> dict:
    recipe = folder / f"{stage}.yaml"
    output = folder / f"out-{stage.replace('+', '-')}"
    recipe.write_text(f"model: {model}\noutput: {output}\ndevice: {device}\ncalibration:\n  dataset: {calibration}\n"
                      f"  num_samples: {samples}\n  seq_len: {seq_len}\nstages:\n{STAGES[stage]}")
    subprocess.run([sys.executable, "-m", "llmc", "quantize", str(recipe)], check=True)
    manifest = json.loads((output / "llmc.json").read_text())
    return {"layer_seconds": [layer["seconds"] for layer in manifest["layers"]], "device": manifest["device"], **manifest["memory"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--only", choices=list(STAGES), action="append")
    args = parser.parse_args()
    layer_bf16_gib = (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336) * 2 / 2**30
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = make_checkpoint(folder / "llama-3-8b-shaped", args.layers)
        calibration = calibration_text(folder, args.samples * args.seq_len)
        for stage in args.only or list(STAGES):
            results[stage] = run(model, folder, stage, calibration, args.samples, args.seq_len, args.device)
    print(f"\nLlama-3-8B-shaped, {args.layers} layers, {args.samples} x {args.seq_len} calibration tokens; "
          f"one layer's bf16 weights: {layer_bf16_gib:.2f} GiB")
    print(f"{'stage':9} {'device':7} {'s/layer':>8} {'32 layers':>10} {'host peak':>10} {'estimate':>9} {'ratio':>6} "
          f"{'device peak':>12} {'estimate':>9}")
    for stage, result in results.items():
        seconds = result["layer_seconds"]
        per_layer = sum(seconds[1:]) / max(1, len(seconds) - 1) if len(seconds) > 1 else seconds[0]  # the first warms up
        estimate = result["estimate"]
        host, device = result["peak_host_rss_gib"], result["peak_device_gib"]
        device_text = "-" if device is None else f"{device:.2f} GiB"
        device_estimate = "-" if estimate["device_gib"] is None else f"{estimate['device_gib']:.2f}"
        print(f"{stage:9} {result['device']:7} {per_layer:8.1f} {32 * per_layer / 60:8.1f} m {host:6.2f} GiB {estimate['host_gib']:9.2f} "
              f"{estimate['host_gib'] / host:6.2f} {device_text:>12} {device_estimate:>9}")
    for stage, result in results.items():
        if result["device"].startswith("cuda") and stage == "gptq":
            seconds = result["layer_seconds"]
            thirty_two = 32 * sum(seconds[1:]) / max(1, len(seconds) - 1)
            batch_gib = 8 * args.seq_len * 4096 * 4 / 2**30  # one batch of float32 activations
            print(f"gptq, 32 layers: {thirty_two:.0f} s = {thirty_two / LLM_COMPRESSOR_GPTQ_8B_S:.2f}x llm-compressor's "
                  f"{LLM_COMPRESSOR_GPTQ_8B_S} s (one GPU, its defaults); device peak {result['peak_device_gib']:.2f} GiB = "
                  f"{result['peak_device_gib'] / (layer_bf16_gib + batch_gib):.2f}x one layer's bf16 weights + one batch")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
