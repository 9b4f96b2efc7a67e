"""What verifying more draft rows costs on this machine: one decoder layer's linear layers (the artifact's own
kernels, e.g. torch's int4 CPU matmul for W4A16) and the LM head, timed at 1, 2, 4, 8 and 16 rows, next to the same
weights dequantized to dense bfloat16, all in one process. A speculative step verifying a tree of N nodes runs N + 1
rows, so where a kernel's time grows with the rows, the tree has to be accepted that much further to pay.

    python benchmarks/verification_rows.py ARTIFACT [--layer 0] [--threads 2]
"""
import argparse
import time

import torch
import torch.nn.functional as F

from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.layers.linear import DenseLinear
from llmc.runtime.llm import LLM

ROWS = (1, 2, 4, 8, 16)


def microseconds(fn, repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e6


def dense_weight(module: torch.nn.Module, in_features: int) -> torch.Tensor:
    """The layer's weight as a dense [out, in] bfloat16 matrix, read back through the layer itself."""
    with torch.inference_mode():
        return module(torch.eye(in_features, dtype=torch.bfloat16)).T.contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = LLM(args.artifact, EngineConfig(enable_prefix_caching=False)).runner.model
    layer = model.layers[args.layer]
    linears = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
               "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj, "lm_head": model.lm_head}
    print(f"{'layer':<14}{'kernel':<16}" + "".join(f"{f'{rows} rows':>16}" for rows in ROWS))
    for name, module in linears.items():
        in_features = module.in_features if hasattr(module, "in_features") else module.weight.shape[1]
        dense = dense_weight(module, in_features)
        inputs = [torch.randn(rows, in_features, dtype=torch.bfloat16) for rows in ROWS]
        kernels = [(type(module).__name__, module)]
        if not isinstance(module, DenseLinear):
            kernels.append(("dense bf16", lambda x, weight=dense: F.linear(x, weight)))
        for label, fn in kernels:
            with torch.inference_mode():
                times = [microseconds(lambda fn=fn, x=x: fn(x)) for x in inputs]
            print(f"{name:<14}{label:<16}" + "".join(f"{t:>9.0f} us x{t / times[0]:<4.1f}" for t in times))


if __name__ == "__main__":
    main()
