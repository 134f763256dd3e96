"""BlockManager creates blocks on first use, and hands blocks out in the order of a free queue that
starts as ``0 .. num_blocks - 1``: never-used blocks first, then freed ones, least recently freed first."""

from distserve.config import SamplingParams
from distserve.engine.block_manager import BlockManager
from distserve.engine.sequence import Sequence


def make_seq(seq_id: str, num_tokens: int, base: int = 0) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_token_ids=[base + i for i in range(num_tokens)], sampling=SamplingParams())


def test_a_large_manager_builds_no_block_until_one_is_taken() -> None:
    bm = BlockManager(num_blocks=1_000_000, block_size=16)
    assert len(bm.ref_counts) == 0 and bm.num_free_blocks == 1_000_000 and bm.usage == 0.0
    s = make_seq("a", 40)  # 3 blocks
    assert bm.allocate(s)
    assert s.block_table == [0, 1, 2] and len(bm.ref_counts) == 3
    assert bm.num_free_blocks == 999_997 and [bm.ref_counts[b] for b in s.block_table] == [1, 1, 1]


def test_never_used_blocks_come_before_freed_ones_in_id_order() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = make_seq("a", 10), make_seq("b", 6)
    assert bm.allocate(a) and bm.allocate(b)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4])
    bm.free(a)  # its table is freed last block first: the queue is 5, 6, 7, then 2, 1, 0
    assert bm.num_free_blocks == 6 and bm.usage == 2 / 8
    c = make_seq("c", 20)  # 5 blocks
    assert bm.allocate(c)
    assert c.block_table == [5, 6, 7, 2, 1]
    assert bm.allocate_blocks(2) is None and bm.allocate_blocks(1) == [0]
    b.num_computed_tokens = 6
    assert bm.num_free_blocks == 0 and not bm.can_append(b, 3)  # b's third block would need a free one
    bm.free(b)
    assert bm.allocate_blocks(2) == [4, 3]


def test_append_slots_takes_fresh_blocks_then_the_oldest_freed() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a, b = make_seq("a", 2), make_seq("b", 2)
    bm.allocate(a)
    bm.allocate(b)
    a.num_computed_tokens = 2
    assert bm.append_slots(a, 1) == [] and a.block_table == [0, 2]
    bm.free(b)  # block 1 freed; block 3 never used: 3 goes first
    a.num_computed_tokens = 4
    assert bm.append_slots(a, 3) == [] and a.block_table == [0, 2, 3, 1]
    a.num_computed_tokens = 7
    assert bm.num_free_blocks == 0 and bm.append_slots(a, 3) is None  # a fifth block: none left


def test_a_prefix_hit_revives_a_freed_block_out_of_the_queue() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq("a", 9)  # blocks 0, 1 full
    bm.allocate(a)
    a.num_computed_tokens = 9
    bm.commit(a)
    bm.free(a)  # queue: 3, 4, 5, then 2, 1, 0 (0 and 1 keep their hashes)
    b = make_seq("b", 9)  # the same tokens: blocks 0 and 1 are hits, revived out of the middle
    assert bm.can_allocate(b) and bm.allocate(b)
    assert b.block_table == [0, 1, 3] and b.num_cached_tokens == 8
    assert bm.num_free_blocks == 3 and bm.allocate_blocks(3) == [4, 5, 2]
