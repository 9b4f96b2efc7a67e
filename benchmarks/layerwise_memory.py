"""Peak memory of `llmc quantize` against model depth: two random Llama checkpoints of the same width, 8 and 32
layers, each quantized (W4A16 g128 RTN, with 16 x 256 calibration tokens flowing layer by layer) in its own
process. The layer-by-layer driver should keep peak RSS nearly flat: goal 32 layers <= 1.25 x 8 layers.

    python benchmarks/layerwise_memory.py [--hidden 1024] [--stage rtn|gptq]
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

STAGES = {
    "rtn": "  - type: rtn\n    scheme: W4A16\n",
    "gptq": "  - type: gptq\n    scheme: W4A16\n",  # adds one Hessian per distinct Linear input to the layer
}


def make_checkpoint(folder: Path, num_layers: int, hidden: int) -> Path:
    code = f"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM, AutoTokenizer
from llmc.checkpoints.spec import resolve_model
config = LlamaConfig(vocab_size=49152, hidden_size={hidden}, intermediate_size={hidden * 11 // 4},
    num_hidden_layers={num_layers}, num_attention_heads={hidden // 64}, num_key_value_heads={hidden // 256},
    tie_word_embeddings=True)
torch.manual_seed(0)
LlamaForCausalLM(config).save_pretrained("{folder}")
AutoTokenizer.from_pretrained(resolve_model("smollm2-135m")).save_pretrained("{folder}")
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    return folder


def peak_rss_mib(command: list[str]) -> float:
    """Peak RSS of one child process (ru_maxrss of RUSAGE_CHILDREN grows monotonically, so run each in a fresh
    wrapper process and read it there)."""
    wrapper = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, "
        "stderr=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    output = subprocess.run([sys.executable, "-c", wrapper, *command], check=True, capture_output=True, text=True)
    return int(output.stdout.strip()) / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--stage", choices=list(STAGES), default="rtn")
    parser.add_argument("--num-samples", type=int, default=16)
    args = parser.parse_args()
    calibration = Path(__file__).resolve().parents[1] / "calib_data" / "smollm2_self_generated.jsonl"
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for num_layers in (8, 32):
            model = make_checkpoint(Path(tmp) / f"llama-{num_layers}", num_layers, args.hidden)
            recipe = Path(tmp) / f"recipe-{num_layers}.yaml"
            recipe.write_text(
                f"model: {model}\noutput: {tmp}/out-{num_layers}\ncalibration:\n  dataset: {calibration}\n"
                f"  num_samples: {args.num_samples}\n  seq_len: 256\nstages:\n{STAGES[args.stage]}"
            )
            quantize = peak_rss_mib([sys.executable, "-m", "llmc", "quantize", str(recipe)])
            checkpoint = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
            results[num_layers] = {"checkpoint_mib": checkpoint, "quantize_peak_rss_mib": quantize}
    print(f"{'layers':>6} {'checkpoint MiB':>15} {'llmc quantize peak RSS MiB':>27}")
    for num_layers, row in results.items():
        print(f"{num_layers:>6} {row['checkpoint_mib']:>15.0f} {row['quantize_peak_rss_mib']:>27.0f}")
    ratio = results[32]["quantize_peak_rss_mib"] / results[8]["quantize_peak_rss_mib"]
    print(f"llmc quantize peak RSS, 32 layers / 8 layers: {ratio:.2f}x (goal <= 1.25x)")
    print(json.dumps({"stage": args.stage, "hidden": args.hidden, "results": results, "ratio_32_over_8": ratio}))


if __name__ == "__main__":
    main()
