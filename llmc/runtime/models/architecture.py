"""What sets one decoder family apart from Llama, read once from config.json and the family's record
(checkpoints/families.py): the one model definition (models/llama.py) turns these options on per layer instead of a
copied file per family."""
import math
from dataclasses import dataclass

from llmc.checkpoints.families import Family, family_for, rope_layer_types, sliding_windows


@dataclass(frozen=True)
class Architecture:
    family: Family  # the model type's record: tensor names, stored projections, norm style, experts
    head_dim: int
    activation: str  # transformers' name of the MLP's activation
    embedding_scale: float | None  # the embeddings multiplied by this (Gemma: sqrt(hidden_size))
    attention_scale: float
    attention_softcap: float | None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None  # the same on the logits
    sliding_windows: tuple[int | None, ...]  # per layer: the keys each query sees, itself included; None: all
    uses_rope: tuple[bool, ...]  # per layer; SmolLM3 leaves some without positions
    layer_types: tuple[str | None, ...]  # per layer, when the config's RoPE differs by layer type (Gemma 3)

    @property
    def any_window(self) -> bool:
        return any(window is not None for window in self.sliding_windows)

    @property
    def plain_attention(self) -> bool:
        """Whether every layer's scores are plain: no sliding window, no soft cap."""
        return not self.any_window and self.attention_softcap is None

    @property
    def min_window(self) -> int | None:
        """The window every layer respects: K/V older than it is read by no layer. None when a layer sees all."""
        if any(window is None for window in self.sliding_windows):
            return None
        return min(self.sliding_windows)


def architecture_of(config) -> Architecture:
    """LlmcError for a model type without a family record (family_for)."""
    family = family_for(config)
    num_layers = config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    scale_base = getattr(config, family.attention_scale_key, None) if family.attention_scale_key else None
    no_rope_layers = getattr(config, "no_rope_layers", None)
    return Architecture(
        family=family,
        head_dim=head_dim,
        activation=getattr(config, "hidden_activation", None) or config.hidden_act,
        embedding_scale=math.sqrt(config.hidden_size) if family.embedding_scale else None,
        attention_scale=(scale_base or head_dim) ** -0.5,
        attention_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        sliding_windows=tuple(sliding_windows(config)),
        uses_rope=tuple(bool(flag) for flag in no_rope_layers) if no_rope_layers else (True,) * num_layers,
        layer_types=tuple(rope_layer_types(config)),
    )
