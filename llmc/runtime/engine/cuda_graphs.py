"""Decode steps as CUDA graphs: the model's forward for one token per sequence is captured once per batch size
(1, 2, 4, ... up to max_num_seqs) over static input buffers, and a step with n sequences replays the smallest graph
that holds them, its padding rows writing K/V into a scratch slot no sequence owns. Kernel launches then cost
one graph launch per step, which is what batch-1 decode is bound by otherwise."""
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from llmc.runtime.layers.attention import AttentionMetadata

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1]
    while sizes[-1] < min(max_num_seqs, MAX_GRAPH_BATCH):
        sizes.append(sizes[-1] * 2)
    return sizes


class DecodeGraphs:
    @staticmethod
    def supported(device: str) -> bool:
        return device.startswith("cuda")

    @torch.inference_mode()
    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks_per_seq: int, scratch_slot: int, device: str):
        self.sizes = graph_batch_sizes(max_num_seqs)
        largest = self.sizes[-1]
        self.scratch_slot = scratch_slot
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.long, device=device)
        self.context_lens = torch.ones(largest, dtype=torch.long, device=device)
        self.replays: dict[int, Callable[[], None]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        for size in reversed(self.sizes):  # the largest first, so the smaller ones reuse its memory pool
            forward = partial(model, self.input_ids[:size], self.positions[:size], self._metadata(size))
            self.replays[size], self.outputs[size], pool = self._capture(forward, pool)

    @staticmethod
    def _capture(forward: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], None], torch.Tensor, object]:
        """(replay, its output buffer, the memory pool to share) of one captured forward."""
        forward()  # warm-up: Triton compiles, the allocator settles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool):
            output = forward()
        torch.cuda.synchronize()
        return graph.replay, output, graph.pool()

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size], seq_lens=[1] * size, query_lens=[1] * size, num_decodes=size,
        )

    def covers(self, metadata: AttentionMetadata) -> bool:
        num_seqs = len(metadata.query_lens)
        return metadata.num_decodes == num_seqs and num_seqs <= self.sizes[-1]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        num_seqs = input_ids.shape[0]
        size = next(size for size in self.sizes if size >= num_seqs)
        self.input_ids[:num_seqs] = input_ids
        self.positions[:num_seqs] = positions
        self.slot_mapping.fill_(self.scratch_slot)
        self.slot_mapping[:num_seqs] = metadata.slot_mapping
        self.context_lens.fill_(1)
        self.context_lens[:num_seqs] = metadata.context_lens
        self.block_tables.zero_()
        self.block_tables[:num_seqs, : metadata.block_tables.shape[1]] = metadata.block_tables
        self.replays[size]()
        return self.outputs[size][:num_seqs]
