from collections import OrderedDict
from dataclasses import dataclass

from llmc.core.integers import cdiv
from llmc.runtime.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its K/V computed
    token_ids: tuple[int, ...] = ()


class BlockManager:
    """Fixed-size KV blocks with reference counts; full blocks are found again by a hash chained over the prefix.
    sliding_window: when every layer attends within it, blocks that fell out of it are given back while the sequence
    runs (release_out_of_window); their block table entries stay, read by no query."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, sliding_window: int | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # the front is reused first: blocks holding nothing, then cached blocks least recently freed first
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (between benchmark runs of the same prompts); only while no sequence holds blocks."""
        if self.num_used_blocks:
            raise RuntimeError(f"reset_prefix_cache: {self.num_used_blocks} blocks are still in use")
        self.hash_to_block_id.clear()

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:  # those need every prompt token computed
            return []
        block_ids, parent_hash = [], None
        for index in range((len(seq) - 1) // self.block_size):  # the last token is always computed
            token_ids = tuple(seq.block(index))
            parent_hash = hash((parent_hash, token_ids))
            block_id = self.hash_to_block_id.get(parent_hash)
            if block_id is None or self.blocks[block_id].token_ids != token_ids:
                break
            block_ids.append(block_id)
        return block_ids

    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens, reusing cached ones; False if too few are free."""
        cached = self._cached_prefix(seq)
        num_revived = sum(self.blocks[block_id].ref_count == 0 for block_id in cached)
        num_new = seq.num_blocks - len(cached)
        if num_new + num_revived > self.num_free_blocks:
            return False
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = cached + [self._take_free_block() for _ in range(num_new)]
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.block_size
        if self.enable_prefix_caching:
            self.num_prefix_query_tokens += len(seq)
            self.num_prefix_hit_tokens += seq.num_cached_tokens
        return True

    def ensure_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the block table to hold num_tokens; False if too few blocks are free."""
        num_needed = cdiv(num_tokens, self.block_size) - len(seq.block_table)
        if num_needed > self.num_free_blocks:
            return False
        seq.block_table += [self._take_free_block() for _ in range(num_needed)]
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def free(self, seq: Sequence) -> None:
        # tail blocks are the least likely to be shared, so they go back first and are evicted first
        for block_id in reversed(seq.block_table[seq.num_released_blocks :]):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_cached_tokens = seq.num_released_blocks = 0
        seq.released_prefix_hash = None

    def release_out_of_window(self, seq: Sequence) -> None:
        """Give back the leading blocks no later query sees: a query at position q reads keys after q - window, and
        the next query is at num_computed_tokens at least. Call after cache_full_blocks (their hashes are kept)."""
        if self.sliding_window is None:
            return
        first_visible = min(seq.num_computed_tokens, len(seq)) - self.sliding_window + 1
        while first_visible >= (seq.num_released_blocks + 1) * self.block_size:
            block = self.blocks[seq.block_table[seq.num_released_blocks]]
            seq.released_prefix_hash = block.hash
            self._release(block.block_id)
            seq.num_released_blocks += 1

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's tokens: they held only rejected draft tokens."""
        while len(seq.block_table) > seq.num_blocks:
            self._release(seq.block_table.pop())

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None
            if block.hash is None:
                self.free_block_ids.move_to_end(block_id, last=False)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full of computed tokens, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        parent_hash = seq.released_prefix_hash
        for index in range(seq.num_released_blocks, min(seq.num_computed_tokens, len(seq)) // self.block_size):
            block = self.blocks[seq.block_table[index]]
            if block.hash is None:
                block.token_ids = tuple(seq.block(index))
                block.hash = hash((parent_hash, block.token_ids))
                self.hash_to_block_id.setdefault(block.hash, block.block_id)
            parent_hash = block.hash
