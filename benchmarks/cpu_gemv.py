"""One matmul at a time on the CPU, in bfloat16, at a decode step's few rows: llmc's nibble GEMV (int4) against
torch's int4 kernel and a dense bfloat16 matmul (oneDNN, weights packed once), and llmc's int8 GEMV against torch's
int8 kernel, for a model's Linear shapes (default SmolLM2-135M's: QKV, O, gate/up, down, the LM head). Prints
microseconds a call and the weights' read rate.

    python benchmarks/cpu_gemv.py [--rows 1 4 16] [--shapes 960x576 576x576 3072x576 576x1536 49152x576] [--group-size 64]
"""
import argparse
import time

import torch

from llmc.quant.qtypes import QuantArgs, quantize_weight
from llmc.runtime.layers import cpu_int8_gemv, cpu_nibble_gemv
from llmc.runtime.layers.linear import Int8CpuLinear, torch_int4_matmul
from llmc.runtime.layers.linear_weight import LinearWeight
from llmc.runtime.layers.onednn_packed import PackedWeight


def microseconds(call, budget_s: float = 0.5) -> float:
    for _ in range(5):
        call()
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < budget_s:
        call()
        calls += 1
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--shapes", nargs="+", default=["960x576", "576x576", "3072x576", "576x1536", "49152x576"])
    parser.add_argument("--group-size", type=int, default=64)
    args = parser.parse_args()
    if not (cpu_nibble_gemv.available() and cpu_int8_gemv.available()):
        raise SystemExit("llmc's GEMVs need AVX-512 BF16 (and a C++ toolchain)")
    print(f"{'shape':>10} {'rows':>4} {'nibble us':>10} {'GB/s':>5} {'torch int4':>10} {'dense bf16':>10} {'int8 GEMV':>10} "
          f"{'GB/s':>5} {'torch int8':>10}")
    with torch.inference_mode():
        for shape in args.shapes:
            out_features, in_features = map(int, shape.split("x"))
            weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
            int4 = quantize_weight(weight, QuantArgs(num_bits=4, group_size=args.group_size))
            scale = int4.scale.bfloat16()
            nibble = cpu_nibble_gemv.NibbleMatmul.int4(int4.codes, scale, args.group_size)
            eager = torch_int4_matmul(int4.codes, scale, args.group_size)
            dense = PackedWeight((int4.codes.float() * scale.float().repeat_interleave(args.group_size, 1)).bfloat16(), None)
            int8 = Int8CpuLinear(LinearWeight(quantize_weight(weight, QuantArgs(num_bits=8, strategy="channel"))), torch.bfloat16, "cpu")
            for rows in args.rows:
                x = torch.randn(rows, in_features).bfloat16()
                calls = [nibble, eager, dense, int8, lambda x, int8=int8: torch.ops.aten._weight_int8pack_mm(x, int8.codes, int8.scales)]
                times = [microseconds(lambda call=call, x=x: call(x)) for call in calls]
                int4_bytes = out_features * in_features / 2 + nibble.scales.numel() * 4
                print(f"{shape:>10} {rows:>4} {times[0]:10.1f} {int4_bytes / times[0] / 1e3:5.1f} {times[1]:10.1f} {times[2]:10.1f} "
                      f"{times[3]:10.1f} {out_features * in_features / times[3] / 1e3:5.1f} {times[4]:10.1f}", flush=True)


if __name__ == "__main__":
    main()
