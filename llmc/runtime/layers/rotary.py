import importlib

import torch
from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from llmc.core.errors import LlmcError
from llmc.runtime.layers import cpu_elementwise

UNSERVED_ROPE_TYPES = ("dynamic",)  # recomputed from the running length: no table serves every step


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def family_rotary_class(config) -> type[nn.Module]:
    """transformers' own rotary embedding for the config's family: every RoPE variant (llama3, yarn, longrope, per
    layer type, partial rotation) is then computed as the reference computes it."""
    model_class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]
    # the modeling module beside the config class's (gemma3_text's lives in transformers.models.gemma3)
    module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    return getattr(module, model_class_name.removesuffix("ForCausalLM") + "RotaryEmbedding")


def rope_types(config) -> list[str]:
    rope = getattr(config, "rope_parameters", None) or {}
    per_type = "rope_type" not in rope and all(isinstance(value, dict) for value in rope.values())
    return [value.get("rope_type", "default") for value in rope.values()] if per_type else [rope.get("rope_type", "default")]


class RotaryEmbedding(nn.Module):
    """RoPE with the scaling the config asks for, tabulated once for every position; with a partial rotary factor
    only the first dimensions of each head turn."""

    def __init__(self, config, max_position: int, dtype: torch.dtype, layer_type: str | None = None):
        super().__init__()
        unserved = [rope_type for rope_type in rope_types(config) if rope_type in UNSERVED_ROPE_TYPES]
        if unserved:
            raise LlmcError(f"RoPE type {unserved[0]!r} is not supported by the llmc runtime")
        reference = family_rotary_class(config)(config=config)
        positions = torch.arange(max_position)[None]
        probe = torch.zeros(1, dtype=torch.float32)
        with torch.no_grad():
            cos, sin = reference(probe, positions, layer_type) if layer_type else reference(probe, positions)
        self.register_buffer("cos", cos[0].to(dtype), persistent=False)  # [positions, rotary_dim]
        self.register_buffer("sin", sin[0].to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, head_dim] (any strides along tokens and heads: queries and keys side by side, rotated in one
        pass) rotated by each token's position."""
        rotary_dim = self.cos.shape[-1]
        if rotary_dim < states.shape[-1]:
            rotated = self.forward(positions, states[..., :rotary_dim])
            return torch.cat([rotated, states[..., rotary_dim:]], dim=-1)
        half = rotary_dim // 2
        if states.is_cuda and half & (half - 1) == 0:  # one fused kernel instead of a dozen; Triton tiles by powers of 2
            from llmc.runtime.layers.triton_elementwise import rotary_triton

            return rotary_triton(states, positions, self.cos, self.sin)
        if cpu_elementwise.serves(states, any_dtype=True):
            return cpu_elementwise.rotary_cpu(states, positions, self.cos, self.sin)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [tokens, 1, rotary_dim]
        return states * cos + rotate_half(states) * sin
