"""One record per model family, read by calibration, export and the runtime alike: where the decoder layers and the
embeddings live, how a layer's Linears are stored, which scales fold into which, and what the runtime's one model
definition turns on for the family (runtime/models/architecture.py). A model type llmc serves is a key of FAMILIES."""
from dataclasses import dataclass, replace

from llmc.core.errors import LlmcError


@dataclass(frozen=True)
class ScalingPair:
    """AWQ/SmoothQuant: `smooth` (a norm, or a Linear whose output rows are scaled) feeds `balance` (Linears
    whose input columns take the inverse scale); `block` is the module whose output the search compares."""

    smooth: str
    balance: tuple[str, ...]
    block: str
    block_is_attention: bool = False  # called with the layer's positions, not just the hidden states
    # Linears reading the same input that take the inverse scale too, so the function stays, but are neither searched
    # nor quantized: a MoE router
    also_scaled: tuple[str, ...] = ()


@dataclass(frozen=True)
class MoeLayout:
    """A sparse mixture-of-experts block as checkpoints (and vLLM) name it: the router `<block>.gate` and, per expert
    e, three 2-D Linears `<block>.experts.<e>.<gate|up|down>`. transformers 5 fuses the experts into 3-D parameters
    in memory; the calibration skeleton puts these Linears back (checkpoints/calibration_moe.py). Config attributes by name."""

    block: str  # under the decoder layer: block_sparse_moe (Mixtral), mlp (Qwen3-MoE)
    gate: str
    up: str
    down: str
    num_experts_key: str
    width_key: str  # an expert's intermediate width
    renormalize_key: str | None = None  # whether the top-k weights are renormalized to sum to 1; None: always

    @property
    def router(self) -> str:
        return f"{self.block}.gate"

    def expert(self, index: int) -> str:
        return f"{self.block}.experts.{index}"

    def num_experts(self, config) -> int:
        return getattr(config, self.num_experts_key)

    def expert_width(self, config) -> int:
        return getattr(config, self.width_key)

    def renormalizes(self, config) -> bool:
        return self.renormalize_key is None or bool(getattr(config, self.renormalize_key))

    def is_sparse(self, config, layer_index: int) -> bool:
        """Whether the layer's MLP is this block; Qwen3-MoE keeps a dense MLP in `mlp_only_layers` and off
        `decoder_sparse_step`."""
        step = getattr(config, "decoder_sparse_step", 1)
        return (self.num_experts(config) > 0 and layer_index not in (getattr(config, "mlp_only_layers", None) or [])
                and (layer_index + 1) % step == 0)

    def scaling_pairs(self, config) -> tuple[ScalingPair, ...]:
        """The norm before the block -> every expert's gate and up (and the router, which is not quantized); each
        expert's up -> its down."""
        experts = [self.expert(index) for index in range(self.num_experts(config))]
        gates_and_ups = tuple(f"{expert}.{name}" for expert in experts for name in (self.gate, self.up))
        into_block = ScalingPair("post_attention_layernorm", gates_and_ups, self.block, also_scaled=(self.router,))
        up_down = tuple(ScalingPair(f"{expert}.{self.up}", (f"{expert}.{self.down}",), f"{expert}.{self.down}") for expert in experts)
        return (into_block, *up_down)


@dataclass(frozen=True)
class Family:
    layers: str = "model.layers"
    embed_tokens: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    # under a decoder layer, the stored Linears that make q, k and v, and the MLP's gate and up, in that order: the
    # runtime stacks each group into one matmul
    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    scaling_pairs: tuple[ScalingPair, ...] = (
        ScalingPair("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn", True),
        ScalingPair("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),  # only when v out == o in
        ScalingPair("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        ScalingPair("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    )
    # their outputs meet in the attention softmax, so a clip's error on their own outputs says little
    no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")
    attention_output: str = "self_attn.o_proj"  # under a decoder layer, the Linear that reads every head's output
    norm_offset: float = 0.0  # norms scale by (offset + weight): Gemma's 1
    embedding_scale: bool = False  # the embeddings multiplied by sqrt(hidden_size) (Gemma)
    # post_attention_layernorm norms the attention's output, and pre_/post_feedforward_layernorm the MLP's input and
    # output (Gemma)
    sandwich_norms: bool = False
    # the config attribute that stands for head_dim in the attention scale head_dim ** -0.5 where the config sets it
    # (Gemma's query_pre_attn_scalar)
    attention_scale_key: str | None = None
    moe: MoeLayout | None = None  # the sparse MoE block of a mixture-of-experts family
    full_precision: tuple[str, ...] = ()  # Linears no stage quantizes, whatever the recipe targets

    def fused_groups(self, names: list[str]) -> list[list[str]]:
        """names grouped as engines stack them into one matmul: q/k/v, and gate/up (an expert's too), by their leaf
        names under one parent; every other Linear alone."""
        fused_leaves = [tuple(path.rsplit(".", 1)[-1] for path in group) for group in (self.qkv, self.gate_up)]
        groups: dict[tuple, list[str]] = {}
        for name in names:
            parent, _, leaf = name.rpartition(".")
            leaves = next((leaves for leaves in fused_leaves if leaf in leaves), None)
            groups.setdefault((parent, leaves) if leaves else (name,), []).append(name)
        return list(groups.values())


LLAMA_LIKE = Family()
# Gemma: post_attention_layernorm norms the attention's output; pre_feedforward_layernorm feeds the MLP
GEMMA = Family(
    scaling_pairs=(
        ScalingPair("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn", True),
        ScalingPair("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        ScalingPair("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        ScalingPair("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ),
    norm_offset=1.0,
    embedding_scale=True,
    sandwich_norms=True,
    attention_scale_key="query_pre_attn_scalar",
)
# Phi-3: q/k/v and gate/up are each one stored Linear, so v -> o and up -> down cannot be scaled
PHI3 = Family(
    qkv=("self_attn.qkv_proj",),
    gate_up=("mlp.gate_up_proj",),
    scaling_pairs=(
        ScalingPair("input_layernorm", ("self_attn.qkv_proj",), "self_attn", True),
        ScalingPair("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
    ),
    no_clip=("self_attn.qkv_proj",),
)
# Mixture of experts. The routers stay in full precision without an ignore entry in the recipe, as llm-compressor's
# MoE recipes keep them: small, and a rounding error there sends tokens to other experts. The dense MLP pairs
# inherited from LLAMA_LIKE apply to Qwen3-MoE's dense layers (`mlp_only_layers`) and match nothing in Mixtral.
MIXTRAL_EXPERTS = MoeLayout("block_sparse_moe", "w1", "w3", "w2", "num_local_experts", "intermediate_size")
QWEN3_MOE_EXPERTS = MoeLayout("mlp", "gate_proj", "up_proj", "down_proj", "num_experts", "moe_intermediate_size", "norm_topk_prob")
MIXTRAL = Family(moe=MIXTRAL_EXPERTS, full_precision=(MIXTRAL_EXPERTS.router,))
QWEN3_MOE = Family(moe=QWEN3_MOE_EXPERTS, full_precision=(QWEN3_MOE_EXPERTS.router,))
FAMILIES = {
    "llama": LLAMA_LIKE, "mistral": LLAMA_LIKE, "qwen2": LLAMA_LIKE, "qwen3": LLAMA_LIKE, "smollm3": LLAMA_LIKE,
    "gemma2": GEMMA, "gemma3_text": GEMMA, "phi3": PHI3, "mixtral": MIXTRAL, "qwen3_moe": QWEN3_MOE,
}


def family_for(config) -> Family:
    """The record of the config's model type, with a MoE family's per-expert scaling pairs; LlmcError for a type llmc
    does not know, before a weight is read."""
    if config.model_type not in FAMILIES:
        raise LlmcError(f"model type {config.model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    family = FAMILIES[config.model_type]
    if family.moe is None:
        return family
    return replace(family, scaling_pairs=family.scaling_pairs + family.moe.scaling_pairs(config))  # per expert: as many as the config has


def sliding_windows(config) -> list[int | None]:
    """Per decoder layer, the keys each query sees (itself included) when the layer attends in a sliding window;
    None where it sees them all."""
    num_layers, window = config.num_hidden_layers, getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", None) is False:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if layer_type == "sliding_attention" else None for layer_type in layer_types]
    return [window] * num_layers


def rope_layer_types(config) -> list[str | None]:
    """Per decoder layer, the key of its RoPE parameters where they differ by layer type (Gemma 3); else None."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope and "rope_type" not in rope and getattr(config, "layer_types", None):
        return list(config.layer_types)
    return [None] * config.num_hidden_layers
