import logging
import time
from typing import Protocol

import torch

from llmc.core.errors import LlmcError
from llmc.core.integers import cdiv
from llmc.runtime.engine.compiled import compile_decoder_layers
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.engine.cuda_graphs import DecodeGraphs
from llmc.runtime.engine.grammar import masked_logits
from llmc.runtime.engine.kernel_policy import amx_int4, attention_backend, build_cpu_kernels, uses_amx
from llmc.runtime.engine.sequence import Sequence
from llmc.runtime.layers.attention import AttentionMetadata, DecodeRows, decode_buckets, padded_length
from llmc.runtime.layers.sampler import SampledToken, sample, token_logprobs
from llmc.runtime.models.architecture import Architecture, architecture_of
from llmc.runtime.models.decode_stack import DecodeStack, refusal
from llmc.runtime.models.llama import LlamaForCausalLM, aux_layer_ids
from llmc.runtime.models.loader import WeightLoader

logger = logging.getLogger(__name__)
PROMPT_LOGPROBS_ROWS = 256  # prompt rows turned into vocabulary-wide logprobs at once, to bound the memory it takes


class Speculator(Protocol):
    """Drafts and verifies tokens in the step that computes `hidden` (the speculative package's decoder)."""

    def step(self, seqs: list[Sequence], hidden: torch.Tensor, started: float) -> dict[Sequence, list[SampledToken]]: ...


def aux_layers_of(hf_config, config: EngineConfig) -> tuple[int, ...]:
    """The layers whose entering residual stream is kept; LlmcError where the options cannot be served together."""
    if config.keep_hidden_states and (config.enable_prefix_caching or config.speculative is not None):
        raise LlmcError("keeping hidden states needs every token computed once, in order: no prefix caching, no drafts")
    if config.aux_hidden_layers and not config.keep_hidden_states:
        raise LlmcError("aux_hidden_layers are kept with keep_hidden_states only")
    return aux_layer_ids(config.aux_hidden_layers, hf_config.num_hidden_layers, "aux_hidden_layers")


def kv_capacity(hf_config, head_dim: int, kv_dtype: torch.dtype, config: EngineConfig) -> tuple[int, int]:
    """(KV blocks, max model length): the blocks kv_cache_gib holds, or num_kv_blocks, at most enough for max_num_seqs
    sequences of max_position_embeddings; the length capped so that one sequence always fits, or preemption could
    not help."""
    num_layers, num_kv_heads = hf_config.num_hidden_layers, hf_config.num_key_value_heads
    block_bytes = 2 * num_layers * config.block_size * num_kv_heads * head_dim * kv_dtype.itemsize
    blocks_per_seq = cdiv(hf_config.max_position_embeddings, config.block_size)
    num_blocks = config.num_kv_blocks or min(int(config.kv_cache_gib * 2**30 // block_bytes), config.max_num_seqs * blocks_per_seq)
    max_positions = hf_config.max_position_embeddings
    return num_blocks, min(config.max_model_len or max_positions, max_positions, num_blocks * config.block_size)


def uses_graphs(arch: Architecture, config: EngineConfig) -> bool:
    """Whether decode steps replay CUDA graphs: not for windows and soft caps, which decode on the torch reference
    whose buckets are worked out on the host, nor where a step's outputs are more than its final states."""
    return (DecodeGraphs.supported(config.device) and not config.enforce_eager and config.speculative is None
            and arch.plain_attention and not config.aux_hidden_layers)


class ModelRunner:
    """Owns the model and the paged KV cache; turns scheduled sequences into one flat batch and samples. On CUDA,
    decode-only steps replay CUDA graphs captured per batch size."""

    def __init__(self, hf_config, weights: WeightLoader, config: EngineConfig):
        arch = architecture_of(hf_config)  # refuses a family llmc does not know
        aux_layers = aux_layers_of(hf_config, config)
        build_cpu_kernels(weights, config)
        self.hf_config, self.keep_hidden_states = hf_config, config.keep_hidden_states
        self.block_size, self.device = config.block_size, config.device
        self.num_blocks, self.max_model_len = kv_capacity(hf_config, arch.head_dim, weights.kv_cache_dtype, config)
        use_graphs = uses_graphs(arch, config)
        # with graphs, one block past those the block manager hands out takes the K/V of padding rows
        self.kv_cache = torch.zeros(
            2, hf_config.num_hidden_layers, self.num_blocks + use_graphs, config.block_size, hf_config.num_key_value_heads,
            arch.head_dim, dtype=weights.kv_cache_dtype, device=config.device,
        )
        self.attention = attention_backend(arch, weights.kv_cache_dtype, config)
        self.model = LlamaForCausalLM(hf_config, weights, self.max_model_len, self.attention, self.kv_cache)
        self.model.aux_layer_ids = aux_layers
        self.amx_s = amx_int4(self.model, config.max_eager_int4_rows) if uses_amx(config) else None
        self.decode_stack = self._decode_stack(config, weights.kv_cache_dtype)
        self.compile_s = None
        if config.compile:
            self.compile_s = compile_decoder_layers(self.model.layers, hf_config.hidden_size, config.dtype, config.device)
        self.speculator: Speculator | None = None  # LLMEngine attaches one when the config names a draft
        self.graphs = None
        if use_graphs:
            max_blocks = cdiv(self.max_model_len, config.block_size)
            self.graphs = DecodeGraphs(self.model, config.max_num_seqs, max_blocks, self.num_blocks * config.block_size, config.device)
        logger.info("KV cache: %d blocks of %d tokens; max model length %d", self.num_blocks, self.block_size, self.max_model_len)

    def _decode_stack(self, config: EngineConfig, kv_dtype: torch.dtype) -> DecodeStack | None:
        if not (config.device == "cpu" and config.cpu_decode_stack and config.cpu_decode_kernel and not config.compile):
            return None
        reason = refusal(self.model, kv_dtype, config.dtype) or ("EAGLE-3 features are kept" if self.model.aux_layer_ids else None)
        if reason is not None:
            logger.info("decode steps run layer by layer: %s", reason)
            return None
        logger.info("decode steps of up to %d rows run the decoder stack in one C++ call", config.max_eager_int4_rows)
        return DecodeStack(self.model, config.max_eager_int4_rows)

    def _prepare(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids, positions, slot_mapping, seq_lens, query_lens, group_seqs = [], [], [], [], [], []
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            tree = seq.draft.truncated(max(0, end - len(seq)))
            input_ids += seq.token_ids[start : end - len(tree)] + tree.tokens
            positions += list(range(start, end - len(tree))) + [len(seq) - 1 + depth for depth in tree.depths]
            slot_mapping += self.slots(seq, list(range(start, end)))
            if len(tree):  # one-token groups: the last token, then every node (cache position len(seq) + node)
                seq_lens += range(start + 1, end + 1)
                query_lens += [1] * (end - start)
                group_seqs += [seq] * (end - start)
            else:
                seq_lens.append(end)
                query_lens.append(end - start)
                group_seqs.append(seq)
        max_blocks = max(len(seq.block_table) for seq in seqs)
        block_tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in group_seqs]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        num_decodes = next((index for index, length in enumerate(query_lens) if length != 1), len(query_lens))
        metadata = AttentionMetadata(
            slot_mapping=tensor(slot_mapping),
            block_tables=tensor(block_tables),
            context_lens=tensor(seq_lens),
            seq_lens=seq_lens,
            query_lens=query_lens,
            num_decodes=num_decodes,
        )
        if any(len(seq.draft) for seq in seqs):
            metadata.decode_rows = self._decode_rows(list(dict.fromkeys(group_seqs[:num_decodes])))
        elif num_decodes and self.attention.prepares_decode_rows:
            metadata.decode_rows = decode_buckets(metadata.block_tables[:num_decodes], metadata.context_lens[:num_decodes],
                                                  self.block_size)
        return tensor(input_ids), tensor(positions), metadata

    def _decode_rows(self, seqs: list[Sequence]) -> list[DecodeRows]:
        """Every decode row of the step, bucketed by the number of key slots it reads."""
        buckets: dict[int, list[tuple[int, torch.Tensor, int]]] = {}
        rows = (row for seq in seqs for row in self._row_keys(seq))
        for index, (slots, length) in enumerate(rows):
            buckets.setdefault(len(slots), []).append((index, slots, length))
        return [
            DecodeRows(torch.tensor(indices, device=self.device), torch.stack(slots), torch.tensor(lengths, device=self.device))
            for indices, slots, lengths in (zip(*bucket) for bucket in buckets.values())
        ]

    def _row_keys(self, seq: Sequence) -> list[tuple[torch.Tensor, int]]:
        """The cache slots each of seq's decode rows reads, padded as decoding pads them, and how many count: the
        last token, then every draft node (cache position len(seq) + node). A node on the chain from the last token
        reads a plain prefix, like decoding it would; the others the prefix of real tokens plus their ancestors."""
        end = seq.num_computed_tokens + seq.num_scheduled_tokens
        tree = seq.draft.truncated(max(0, end - len(seq)))
        rows: list[tuple[int, list[int]]] = [(end - len(tree), [])]
        for node in range(len(tree)):
            path = tree.path(node)
            on_chain = path == list(range(node + 1))
            rows.append((len(seq) + node + 1, []) if on_chain else (len(seq), [len(seq) + ancestor for ancestor in path]))
        seq_slots = self._block_slots(seq, end)
        keys = []
        for prefix_len, branch in rows:
            length = prefix_len + len(branch)
            padding = [0] * (padded_length(length, self.block_size) - length)  # position 0, masked
            index = torch.cat([torch.arange(prefix_len), torch.tensor(branch + padding, dtype=torch.long)])
            keys.append((seq_slots[index.to(self.device)], length))
        return keys

    def _block_slots(self, seq: Sequence, num_positions: int) -> torch.Tensor:
        """Every cache slot of the blocks holding the first num_positions positions; the tail past them is masked."""
        blocks = torch.tensor(seq.block_table[: cdiv(num_positions, self.block_size)], device=self.device)
        return (blocks[:, None] * self.block_size + torch.arange(self.block_size, device=self.device)).flatten()

    def slots(self, seq: Sequence, positions: list[int]) -> list[int]:
        return [seq.block_table[p // self.block_size] * self.block_size + p % self.block_size for p in positions]

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence]) -> torch.Tensor:
        """The final hidden states of every scheduled token (their K/V go into the cache)."""
        input_ids, positions, metadata = self._prepare(seqs)
        if self.graphs is not None and self.graphs.covers(metadata):
            return self.graphs.replay(input_ids, positions, metadata)
        if self.decode_stack is not None and self.decode_stack.covers(metadata):
            return self.model.norm(self.decode_stack(self.model.embed(input_ids), positions, metadata))
        return self.model(input_ids, positions, metadata)

    def _keep_hidden_states(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        sizes = [seq.num_scheduled_tokens for seq in seqs]
        aux = self.model.aux_hidden
        for seq, states, aux_states in zip(seqs, hidden.split(sizes), aux.split(sizes) if aux is not None else [None] * len(seqs)):
            if seq.num_computed_tokens == 0:  # a preempted sequence starts again from its first token
                seq.hidden_states.clear()
                seq.aux_hidden_states.clear()
            seq.hidden_states.append(states.to("cpu", torch.float32))  # host memory: a long distillation outgrows a GPU's
            if aux_states is not None:
                seq.aux_hidden_states.append(aux_states.to("cpu", torch.float32))

    def _record_prompt_logprobs(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        """For sequences that ask for them, the logprobs of the prompt tokens this step's chunk predicts (each row
        predicts the next position's token); a preempted sequence's recomputed rows are not recorded twice."""
        rows, targets, end = [], [], 0
        for seq in seqs:
            start, end = end, end + seq.num_scheduled_tokens
            if seq.params.prompt_logprobs is None:
                continue
            # the row at position p predicts the token at p + 1; prompt positions only, from the first missing one
            first, last = len(seq.prompt_logprobs), min(seq.num_prompt_tokens, seq.num_computed_tokens + end - start + 1)
            rows += range(start + first - 1 - seq.num_computed_tokens, start + last - 1 - seq.num_computed_tokens)
            targets += [(seq, token_id) for token_id in seq.token_ids[first:last]]
        for first in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            chunk = rows[first : first + PROMPT_LOGPROBS_ROWS]
            logprobs = self.model.compute_logits(hidden[torch.tensor(chunk, device=self.device)]).float().log_softmax(-1)
            for row_logprobs, (seq, token_id) in zip(logprobs, targets[first : first + PROMPT_LOGPROBS_ROWS]):
                seq.prompt_logprobs.append(token_logprobs(token_id, row_logprobs, seq.params.prompt_logprobs))

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> dict[Sequence, list[SampledToken]]:
        """Compute the scheduled tokens of every sequence; sample for those whose scheduled chunk reaches their last
        token: one token, or with a speculator the accepted drafts plus one."""
        seqs = sorted(seqs, key=lambda seq: seq.num_uncomputed_tokens > 1)  # decodes (with their drafts) first
        started = time.perf_counter()
        hidden = self.forward(seqs)
        self._record_prompt_logprobs(seqs, hidden)
        if self.speculator is not None:
            return self.speculator.step(seqs, hidden, started)
        if self.keep_hidden_states:
            self._keep_hidden_states(seqs, hidden)
        rows, sampling_seqs, end = [], [], 0
        for seq in seqs:
            end += seq.num_scheduled_tokens
            if seq.num_computed_tokens + seq.num_scheduled_tokens == len(seq):
                rows.append(end - 1)
                sampling_seqs.append(seq)
        if not sampling_seqs:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        grammars = [seq.grammar for seq in sampling_seqs]
        constrained = masked_logits(logits, grammars) if any(grammar is not None for grammar in grammars) else None
        tokens = sample(logits, [seq.params for seq in sampling_seqs], [seq.generator for seq in sampling_seqs], constrained)
        return {seq: [token] for seq, token in zip(sampling_seqs, tokens)}
