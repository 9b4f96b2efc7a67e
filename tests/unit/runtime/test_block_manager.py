import pytest

from llmc.runtime.engine.block_manager import BlockManager
from llmc.runtime.engine.sequence import Sequence
from llmc.runtime.sampling_params import SamplingParams


def sequence(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(), block_size=4)


def computed(manager: BlockManager, seq: Sequence) -> Sequence:
    assert manager.allocate(seq)
    seq.num_computed_tokens = len(seq)
    manager.cache_full_blocks(seq)
    return seq


def test_prefix_blocks_are_shared_and_counted():
    manager = BlockManager(num_blocks=6, block_size=4)
    first = computed(manager, sequence(list(range(10))))
    assert first.num_cached_tokens == 0
    second = sequence(list(range(8)) + [50, 51])
    assert manager.allocate(second)
    assert second.block_table[:2] == first.block_table[:2] and second.num_computed_tokens == 8
    assert [manager.blocks[b].ref_count for b in first.block_table] == [2, 2, 1]
    assert manager.num_prefix_hit_tokens == 8
    manager.free(second)
    manager.free(first)
    assert manager.num_free_blocks == 6 and manager.num_used_blocks == 0


def test_empty_blocks_are_reused_first_then_cached_ones_tail_first():
    manager = BlockManager(num_blocks=4, block_size=4)
    first = computed(manager, sequence(list(range(9))))
    head, middle, tail = first.block_table
    manager.free(first)
    assert list(manager.free_block_ids) == [tail, 3, middle, head]
    other = sequence([100 + i for i in range(12)])
    assert manager.allocate(other) and other.block_table == [tail, 3, middle]
    manager.free(other)
    again = sequence(list(range(9)))
    assert manager.allocate(again) is True and again.num_cached_tokens == 4 and again.block_table[0] == head


def test_hash_hit_with_other_tokens_is_not_reused():
    manager = BlockManager(num_blocks=4, block_size=4)
    first = computed(manager, sequence([1, 2, 3, 4, 5]))
    block = manager.blocks[first.block_table[0]]
    block.token_ids = (9, 9, 9, 9)  # as if another prefix had collided on the same hash
    second = sequence([1, 2, 3, 4, 6])
    assert manager.allocate(second) and second.num_cached_tokens == 0
    assert manager.allocate(sequence([1])) is False  # all four blocks are in use


def test_reset_prefix_cache_forgets_every_prefix_and_refuses_while_blocks_are_held():
    manager = BlockManager(num_blocks=6, block_size=4)
    first = computed(manager, sequence(list(range(10))))
    with pytest.raises(RuntimeError, match="still in use"):
        manager.reset_prefix_cache()
    manager.free(first)
    manager.reset_prefix_cache()
    again = sequence(list(range(10)))
    assert manager.allocate(again) and again.num_computed_tokens == 0  # computed afresh, as on first sight
    computed(manager, again)
    manager.free(again)
    assert manager.allocate(third := sequence(list(range(10)))) and third.num_computed_tokens == 8  # cached again after
