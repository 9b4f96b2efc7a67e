"""The decoder layers' pieces around the paged attention under torch.compile: norm, QKV projection and rotary
before it, output projection, residuals, norm and MLP after it. Their shapes are static but for the number of
tokens, so graphs dynamic in it (not specialised even to one token) serve every layer, every batch and every
prefill chunk; the attention itself stays eager, reading the cache by each step's lengths.
Inductor fuses the elementwise work into a few C++ (CPU) loops and calls the matmul kernels directly. Compiled
code is cached on disk (inductor's FX graph cache, under LLMC_HOME/inductor), so a later start reuses it."""
import logging
import time

import torch
from torch import nn

from llmc.runtime.layers.inductor_cache import use_llmc_inductor_cache

logger = logging.getLogger(__name__)
PIECES = ("attention_inputs", "attention_output")


def rows_unbacked(compiled):
    """The number of tokens as a size dynamo does not specialise, not even to 1: one token and many run the same
    graph. (That alone does not make bfloat16 rows independent of the batch: see EngineConfig.compile.)"""
    def call(first: torch.Tensor, second: torch.Tensor):
        torch._dynamo.decorators.mark_unbacked(first, 0)
        torch._dynamo.decorators.mark_unbacked(second, 0)
        return compiled(first, second)

    return call


def compile_decoder_layers(layers: nn.ModuleList, hidden_size: int, dtype: torch.dtype, device: str) -> float:
    """Every layer's pieces replaced by their compiled versions, compiled now; returns the seconds that took."""
    use_llmc_inductor_cache()
    started = time.perf_counter()
    for layer in layers:
        for piece in PIECES:
            setattr(layer, piece, rows_unbacked(torch.compile(getattr(layer, piece), dynamic=True)))
    with torch.inference_mode():
        hidden = torch.zeros(2, hidden_size, dtype=dtype, device=device)
        q, _, _ = layers[0].attention_inputs(torch.zeros(2, dtype=torch.long, device=device), hidden)
        layers[0].attention_output(hidden, torch.zeros_like(q))
    seconds = time.perf_counter() - started
    logger.info("compiled the decoder layers' pieces in %.1f s", seconds)
    return seconds
