import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from llmc.errors import LlmcError


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    """RoPE with the scaling the config asks for (linear, llama3, yarn, ...), tabulated once for every position."""

    def __init__(self, config, head_dim: int, max_position: int, dtype: torch.dtype):
        super().__init__()
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            inv_freq = 1.0 / (rope.get("rope_theta", 10000.0) ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        elif rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
            raise LlmcError(f"RoPE type {rope_type!r} is not supported by the llmc runtime")
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq.float()
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (angles.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (angles.sin() * scaling).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, head_dim] (any strides along tokens and heads: queries and keys side by side, rotated in one
        pass) rotated by each token's position."""
        half = states.shape[-1] // 2
        if states.is_cuda and half & (half - 1) == 0:  # one fused kernel instead of a dozen; Triton tiles by powers of 2
            from llmc.runtime.layers.triton_elementwise import rotary_triton

            return rotary_triton(states, positions, self.cos, self.sin)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [tokens, 1, head_dim]
        return states * cos + rotate_half(states) * sin
