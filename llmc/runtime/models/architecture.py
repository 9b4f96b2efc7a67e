"""What sets one decoder family apart from Llama, read once from config.json: the one model definition
(models/llama.py) turns these options on per layer instead of a copied file per family."""
import math
from dataclasses import dataclass

from llmc.checkpoints.families import FAMILIES, rope_layer_types, sliding_windows
from llmc.core.errors import LlmcError

# model types the runtime serves: dense Llama-like families, and the mixture-of-experts ones (layers/moe.py)
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma2", "gemma3_text", "phi3")
MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES
GEMMA = ("gemma2", "gemma3_text")


@dataclass(frozen=True)
class Architecture:
    head_dim: int
    activation: str  # transformers' name of the MLP's activation
    norm_offset: float  # RMSNorm gains are stored minus this (Gemma: 1)
    embedding_scale: float | None  # the embeddings multiplied by this (Gemma: sqrt(hidden_size))
    sandwich_norms: bool  # norms after the attention and the MLP too (Gemma)
    attention_scale: float
    attention_softcap: float | None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None  # the same on the logits
    sliding_windows: tuple[int | None, ...]  # per layer: the keys each query sees, itself included; None: all
    uses_rope: tuple[bool, ...]  # per layer; SmolLM3 leaves some without positions
    layer_types: tuple[str | None, ...]  # per layer, when the config's RoPE differs by layer type (Gemma 3)
    fused_projections: bool  # qkv_proj and gate_up_proj stored as one Linear each (Phi-3)

    @property
    def any_window(self) -> bool:
        return any(window is not None for window in self.sliding_windows)

    @property
    def min_window(self) -> int | None:
        """The window every layer respects: K/V older than it is read by no layer. None when a layer sees all."""
        if any(window is None for window in self.sliding_windows):
            return None
        return min(self.sliding_windows)


def architecture_of(config) -> Architecture:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise LlmcError(f"the llmc runtime serves {', '.join(SUPPORTED_MODEL_TYPES)} models, not {config.model_type!r}")
    num_layers = config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    gemma, family = config.model_type in GEMMA, FAMILIES[config.model_type]
    pre_attention_scalar = getattr(config, "query_pre_attn_scalar", None)
    no_rope_layers = getattr(config, "no_rope_layers", None)
    return Architecture(
        head_dim=head_dim,
        activation=getattr(config, "hidden_activation", None) or config.hidden_act,
        norm_offset=family.norm_offset,
        embedding_scale=math.sqrt(config.hidden_size) if family.embedding_scale else None,
        sandwich_norms=gemma,
        attention_scale=(pre_attention_scalar if gemma and pre_attention_scalar else head_dim) ** -0.5,
        attention_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        sliding_windows=tuple(sliding_windows(config)),
        uses_rope=tuple(bool(flag) for flag in no_rope_layers) if no_rope_layers else (True,) * num_layers,
        layer_types=tuple(rope_layer_types(config)),
        fused_projections=config.model_type == "phi3",
    )

