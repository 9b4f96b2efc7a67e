"""The decoder layers' pieces around the paged attention under torch.compile: norm, QKV projection and rotary
before it, output projection, residuals, norm and MLP after it. Their shapes are static but for the number of
tokens, so one graph dynamic in it (and one specialised to a single token, as dynamo does) serves every layer,
every batch and every prefill chunk; the attention itself stays eager, reading the cache by each step's lengths.
Inductor fuses the elementwise work into a few C++ (CPU) loops and calls the matmul kernels directly. Compiled
code is cached on disk (inductor's FX graph cache, under LLMC_HOME/inductor), so a later start reuses it."""
import logging
import os
import time

import torch
from torch import nn

from llmc.models.spec import llmc_home

logger = logging.getLogger(__name__)
PIECES = ("attention_inputs", "attention_output")


def compile_decoder_layers(layers: nn.ModuleList, hidden_size: int, dtype: torch.dtype, device: str) -> float:
    """Every layer's pieces replaced by their compiled versions, compiled now for one token and for several (the two
    graphs dynamo makes); returns the seconds that took."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(llmc_home() / "inductor"))
    started = time.perf_counter()
    for layer in layers:
        for piece in PIECES:
            setattr(layer, piece, torch.compile(getattr(layer, piece), dynamic=True))
    with torch.inference_mode():
        for num_tokens in (1, 2):
            hidden = torch.zeros(num_tokens, hidden_size, dtype=dtype, device=device)
            positions = torch.zeros(num_tokens, dtype=torch.long, device=device)
            q, _, _ = layers[0].attention_inputs(positions, hidden)
            layers[0].attention_output(hidden, torch.zeros_like(q))
    seconds = time.perf_counter() - started
    logger.info("compiled the decoder layers' pieces in %.1f s", seconds)
    return seconds
