"""bfloat16 weights packed once for oneDNN's GEMM on the CPU."""
import torch
from torch import nn


def packs_for_onednn(dtype: torch.dtype, device: str) -> bool:
    """bfloat16 on the CPU: oneDNN multiplies weights it packed once at load (torch's mkldnn linear, as inductor's
    freezing packs them) without repacking them on every call, as it does plain ones, at the same bits."""
    return dtype == torch.bfloat16 and device == "cpu" and onednn_runs_bfloat16()


def onednn_runs_bfloat16() -> bool:
    """oneDNN's bfloat16 GEMM needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on older CPUs it refuses to pack."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedWeight(nn.Module):
    """x @ weight.T (+ bias) on a weight packed for oneDNN's bfloat16 GEMM; where oneDNN cannot run bfloat16, the
    plain weight through torch's linear (same product, accumulated in float32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.onednn = onednn_runs_bfloat16()
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKING_ROWS) if self.onednn
                       else weight.contiguous())
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.onednn:
            return torch.nn.functional.linear(x, self.packed, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


PACKING_ROWS = 16  # the rows oneDNN is told to expect when it picks the packed layout
