"""Int4 weight-only matmuls on the CPU's AMX tiles. torch's eager int4 CPU kernel multiplies row by row on AVX-512,
its time growing with the rows; compiled by inductor, the same op runs on a C++ GEMM template that widens int4 tiles
to bfloat16 and multiplies them on AMX, several times faster from a few rows up. The template takes the weights as
constants of the graph (inductor's freezing), so each Linear gets its own graph, dynamic in the number of rows: one
graph serves two rows to any number, and a row's bits do not depend on the rows beside it. A single row runs as two,
since a graph specialised to one row would compute it another way. Each compiled matmul is checked against the eager
kernel before it serves, and stays eager if they disagree."""
import logging
import types
from collections.abc import Callable

import torch
from torch import nn

from llmc.runtime.layers.inductor_cache import use_llmc_inductor_cache

logger = logging.getLogger(__name__)
# inductor's FX graph cache keys a frozen graph without its constants' values: it would hand one Linear's weights to
# the next Linear of the same shape
INDUCTOR_SETTINGS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP", "fx_graph_cache": False}
PROBE_ROWS = 64  # also the rows the template blocks its loops for
MAX_RELATIVE_ERROR = 0.02  # a wrong graph is off by the weights' whole size; bfloat16 rounding by under 1%


def amx_available() -> bool:
    return torch.cpu._is_amx_tile_supported()


class Int4Matmul(nn.Module):
    """x [rows, in] times symmetric int4 weights in torch's CPU layout (codes + 8 packed two a byte, zero term 0)."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int):
        super().__init__()
        self.group_size = group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)


def _own_forward(matmul: Int4Matmul) -> Callable[[torch.Tensor], torch.Tensor]:
    """matmul's forward on a copy of its code: dynamo keeps compiled graphs per code object, so a model's Linears on
    one code object would pass its recompile limit and check a long list of guards on every call."""
    code = Int4Matmul.forward.__code__.replace(co_name=f"int4_matmul_{id(matmul):x}")
    return types.MethodType(types.FunctionType(code, Int4Matmul.forward.__globals__), matmul)


def compile_amx(matmul: Int4Matmul, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """matmul compiled onto the AMX template (compiled now), or None where the compiled graph disagrees with eager."""
    use_llmc_inductor_cache()
    compiled = torch.compile(_own_forward(matmul), dynamic=False)
    with torch.inference_mode(), torch._inductor.config.patch(INDUCTOR_SETTINGS):  # the engine's steps run in inference mode
        probe = torch.randn(PROBE_ROWS, matmul.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
        torch._dynamo.decorators.mark_dynamic(probe, 0)
        got = compiled(probe)
        expected = matmul(probe)
    error = ((got.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-6)).item()
    if error > MAX_RELATIVE_ERROR:
        logger.warning("an int4 matmul compiled for AMX is off by %.0f%% of its output: it stays on the eager kernel", error * 100)
        return None
    return compiled
