"""Per architecture: where the decoder layers and the embeddings live, and which Linears a layer holds."""
from dataclasses import dataclass

from llmc.errors import LlmcError


@dataclass(frozen=True)
class ScalingPair:
    """AWQ/SmoothQuant: `smooth` (a norm, or a Linear whose output rows are scaled) feeds `balance` (Linears
    whose input columns take the inverse scale); `block` is the module whose output the search compares."""

    smooth: str
    balance: tuple[str, ...]
    block: str
    block_is_attention: bool = False  # called with the layer's positions, not just the hidden states


@dataclass(frozen=True)
class Family:
    layers: str = "model.layers"
    embed_tokens: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    linears: tuple[str, ...] = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
    scaling_pairs: tuple[ScalingPair, ...] = (
        ScalingPair("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn", True),
        ScalingPair("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),  # only when v out == o in
        ScalingPair("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        ScalingPair("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    )
    # their outputs meet in the attention softmax, so a clip's error on their own outputs says little
    no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")


LLAMA_LIKE = Family()
FAMILIES = {"llama": LLAMA_LIKE, "mistral": LLAMA_LIKE, "qwen2": LLAMA_LIKE, "qwen3": LLAMA_LIKE}


def family_for(config) -> Family:
    if config.model_type not in FAMILIES:
        raise LlmcError(f"model type {config.model_type!r} is not supported yet; supported: {', '.join(FAMILIES)}")
    return FAMILIES[config.model_type]
