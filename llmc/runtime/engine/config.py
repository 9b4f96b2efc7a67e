from dataclasses import dataclass
from pathlib import Path

import torch

from llmc.core.errors import LlmcError


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: as many as kv_cache_gib holds
    kv_cache_gib: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # token budget of one step; longer prompts are prefilled in chunks
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped by the KV cache
    enable_prefix_caching: bool = True
    dtype: torch.dtype = torch.bfloat16  # float32 runs the exact path (dense matmuls), bfloat16 the int4 kernels
    # weight-only quantized weights dequantized at load onto dense matmuls: the same weights, at other rounding than
    # the serving kernels; on CPU faster at many rows a step, where the time of torch's int4 kernel grows with the rows
    dense_weights: bool = False
    # a CPU with AMX, bfloat16: int4 layers compiled onto inductor's AMX int4 GEMM (layers/int4_amx.py) at start;
    # False keeps torch's eager int4 kernel for every step, as does compile (its graphs hold the int4 op themselves)
    amx_int4: bool = True
    # a CPU without AMX (or amx_int4 off), bfloat16: int4 layers keep a bfloat16 copy of their weights for steps of more
    # than max_eager_int4_rows tokens (prefill chunks, large batches), where torch's int4 kernel, row by row, is slower
    # than a dense GEMM; it takes 4x the int4 weights' memory. False: every step on the int4 kernel
    int4_dense_copy: bool = True
    # steps of at most this many tokens keep torch's eager int4 kernel, faster for a few rows; the others run on AMX or
    # the dense copy. A token's bits then depend on whether its step had more tokens than this. 0: every step on AMX
    # or the dense copy, bits independent of the batch
    max_eager_int4_rows: int = 12
    device: str = "cpu"
    # CPU: decode attention in one C++ kernel compiled on first use (layers/cpu_attention.py); False, or a cache in
    # FP8, or no compiler: the torch reference
    cpu_decode_kernel: bool = True
    # CPU, bfloat16, 4-bit Linears on the nibble kernel: decode-only steps of at most max_eager_int4_rows rows run the
    # whole decoder stack in one C++ call (layers/cpu_decode_stack.py) where the model's layers allow; False: layer by
    # layer. Off with compile or without cpu_decode_kernel, which ask for the other paths
    cpu_decode_stack: bool = True
    # every sequence keeps the final hidden state (float32) of each token it computes, in Sequence.hidden_states:
    # self-distillation reads the features it trains on from the generation itself instead of a second pass
    keep_hidden_states: bool = False
    # with keep_hidden_states, the residual stream entering these layers is kept too (Sequence.aux_hidden_states,
    # float32, joined in layer order): the features an EAGLE-3 draft fuses, in vLLM's numbering (0: the embeddings)
    aux_hidden_layers: tuple[int, ...] = ()
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of replaying captured CUDA graphs
    # CPU: torch.compile the decoder layers' pieces around the attention (engine/compiled.py), compiled at start and
    # cached on disk. Float32 greedy output still equals transformers'; bfloat16 output may depend on the batch (a
    # full test run saw a 40-token answer differ from token 25). False runs every op eagerly, the reference path
    compile: bool = False
    speculative: Path | None = None  # a draft folder (config.json + heads) to propose tokens with
    # the draft's shape, None: the method's default (speculative.shape.DEFAULT_SHAPES)
    num_speculative_tokens: int | None = None  # draft depth
    speculative_tree_nodes: int | None = None  # verify a tree of this many nodes, the most probable paths; 0: a chain
    speculative_min_confidence: float | None = None  # verify only draft nodes whose path the draft finds at least this probable
    speculative_max_num_seqs: int = 4  # above this many sequences in a step, decode without drafts
    adaptive_speculation: bool = True  # draft only while measured decode throughput with drafts beats it without

    def __post_init__(self) -> None:
        if self.compile and not self.device.startswith("cpu"):
            raise LlmcError("compile runs on the CPU; on CUDA decode steps replay captured CUDA graphs instead")


def native_bfloat16(device: str) -> bool:
    """Whether bfloat16 matmuls run in hardware. A CPU without AVX-512 BF16 or AMX has torch emulate them, at several
    times float32's cost (docs/speculative.md)."""
    if device.startswith("cuda"):
        return True
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
