"""Per architecture: where the decoder layers and the embeddings live, and which Linears a layer holds."""
from dataclasses import dataclass

from llmc.errors import LlmcError


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


LLAMA_LIKE = Family()
FAMILIES = {"llama": LLAMA_LIKE, "mistral": LLAMA_LIKE, "qwen2": LLAMA_LIKE, "qwen3": LLAMA_LIKE}


def family_for(config) -> Family:
    if config.model_type not in FAMILIES:
        raise LlmcError(f"model type {config.model_type!r} is not supported yet; supported: {', '.join(FAMILIES)}")
    return FAMILIES[config.model_type]
