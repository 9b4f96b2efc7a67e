import torch
from torch import nn

from llmc.runtime.layers import cpu_elementwise


class RMSNorm(nn.Module):
    """offset: the stored gain is the norm's weight minus it (Gemma stores w and scales by 1 + w, in float32)."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0):
        super().__init__()
        gain = weight.float() + offset if offset else weight
        self.weight = nn.Parameter(gain, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one fused kernel instead of seven
            from llmc.runtime.layers.triton_elementwise import rms_norm_triton

            return rms_norm_triton(x, self.weight.to(x.dtype), self.eps)
        if self.weight.dtype in (x.dtype, torch.float32) and cpu_elementwise.serves(x):
            return cpu_elementwise.rms_norm_cpu(x, self.weight, self.eps)
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight.dtype == torch.float32:
            return (self.weight * x).to(input_dtype)
        return self.weight * x.to(input_dtype)
