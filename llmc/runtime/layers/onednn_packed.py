"""bfloat16 weights packed once for oneDNN's GEMM on the CPU."""
import torch
from torch import nn


def packs_for_onednn(dtype: torch.dtype, device: str) -> bool:
    """bfloat16 on the CPU: oneDNN multiplies weights it packed once at load (torch's mkldnn linear, as inductor's
    freezing packs them) without repacking them on every call, as it does plain ones, at the same bits."""
    return dtype == torch.bfloat16 and device == "cpu" and torch.backends.mkldnn.is_available()


class PackedWeight(nn.Module):
    """x @ weight.T (+ bias) on a weight packed for oneDNN's bfloat16 GEMM."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKING_ROWS)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


PACKING_ROWS = 16  # the rows oneDNN is told to expect when it picks the packed layout
