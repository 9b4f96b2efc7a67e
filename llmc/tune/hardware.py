"""What a Linear costs in each format on the objective's target: bytes as the artifact stores them (`smallest`),
seconds of its batch-1 kernel timed on this machine (`this-machine`), or bytes over a GPU's memory bandwidth (a GPU
by name: batch-1 decode reads every weight once a token, so it is bandwidth bound; docs/tune.md)."""
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from llmc.artifact.compressed_tensors import compressed_tensors_tensors
from llmc.quant.qtypes import QuantArgs, QuantizedWeight
from llmc.runtime.layers.linear import build_linear
from llmc.runtime.layers.linear_weight import LinearWeight

TIMED_REPEATS = 40


@dataclass(frozen=True)
class Gpu:
    name: str
    bandwidth_gb_s: float  # peak HBM bandwidth, the vendor's figure
    arch: str  # ampere, ada, hopper, blackwell


GPUS = {
    "A100": Gpu("A100", 2039, "ampere"),  # 80 GB SXM
    "L40S": Gpu("L40S", 864, "ada"),
    "H100": Gpu("H100", 3350, "hopper"),  # SXM
    "H200": Gpu("H200", 4800, "hopper"),
    "B200": Gpu("B200", 8000, "blackwell"),
}
ARCH_ORDER = ("ampere", "ada", "hopper", "blackwell")
# the first architecture on which vLLM 0.32 has a kernel for the scheme (docs/tune.md); absent: every one listed.
# Marlin runs 4- and 8-bit weights only, so 3- and 2-bit integer weights have no vLLM GPU kernel.
FIRST_ARCH = {"W4AFP8": "hopper", "W4A8": "hopper", "NVFP4": "blackwell", "MXFP4": "blackwell", "MXFP8": "blackwell",
              "MXFP8A16": "blackwell"}
NO_GPU_KERNEL = {"W3A16", "W2A16"}


def gpu_refusal(scheme: str, gpu: Gpu) -> str | None:
    """Why vLLM cannot serve the scheme on the GPU, or None."""
    if scheme in NO_GPU_KERNEL:
        return f"{scheme}: vLLM's GPU kernels (Marlin) take 4- and 8-bit integer weights only"
    first = FIRST_ARCH.get(scheme)
    if first and gpu.arch in ARCH_ORDER and ARCH_ORDER.index(gpu.arch) < ARCH_ORDER.index(first):
        return f"{scheme}: vLLM's kernel for it needs {first} or newer, {gpu.name} is {gpu.arch}"
    return None


def stored_bytes(name: str, weight: QuantizedWeight | torch.Tensor, dtype: torch.dtype) -> int:
    """The Linear's weight as the artifact stores it (codes, scales, zero points), or unquantized in dtype."""
    if isinstance(weight, torch.Tensor):
        return weight.numel() * dtype.itemsize
    return sum(tensor.numel() * tensor.element_size() for tensor in compressed_tensors_tensors(name, weight).values())


def batch1_seconds(weights: list[QuantizedWeight | torch.Tensor], activations: QuantArgs | None) -> float:
    """The runtime's kernel for these stacked Linears (q/k/v, gate/up, or one) on one bfloat16 row, median of
    TIMED_REPEATS calls."""
    parts = [LinearWeight(replace(weight, input_activations=activations) if isinstance(weight, QuantizedWeight)
                          else weight.to(torch.bfloat16)) for weight in weights]
    layer = build_linear(parts, torch.bfloat16, "cpu")
    width = (weights[0].codes if isinstance(weights[0], QuantizedWeight) else weights[0]).shape[1]
    row = torch.randn(1, width, dtype=torch.bfloat16)
    samples = []
    with torch.inference_mode():
        for _ in range(3):
            layer(row)
        for _ in range(TIMED_REPEATS):
            started = time.perf_counter()
            layer(row)
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def decode_tokens_per_second(artifact: Path, tokens: int = 128) -> float:
    """The runtime's batch-1 greedy decode rate on this machine: one request's N + 1 tokens less its first, after a
    warm-up run; the median of three."""
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    llm = LLM(artifact)
    prompt = "Write a long story about a lighthouse keeper and the storm that changed her town."

    def seconds(count: int) -> float:
        started = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=count, ignore_eos=True))
        return time.perf_counter() - started

    seconds(tokens + 1)  # warm-up: kernels built for every length the run reaches, the prompt cached
    return statistics.median(tokens / (seconds(tokens + 1) - seconds(1)) for _ in range(3))
