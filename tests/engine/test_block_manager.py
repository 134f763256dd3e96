"""BlockManager: allocation, prefix reuse, copy-on-write, free and eviction."""

from distserve.config import SamplingParams
from distserve.engine.block_manager import BlockManager, prefix_block_hashes
from distserve.engine.sequence import Sequence


def make_seq(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_token_ids=list(tokens), sampling=SamplingParams())


def computed(bm: BlockManager, seq: Sequence) -> None:
    """Pretend the runner filled the KV of all tokens but the last."""
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def test_allocate_and_free_returns_all_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", list(range(10)))  # 3 blocks
    assert bm.can_allocate(seq)
    assert bm.allocate(seq)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_allocation_says_no_when_full() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    big = make_seq("a", list(range(9)))  # needs 3 blocks
    assert not bm.can_allocate(big)
    assert bm.allocate(big) is False
    assert bm.num_free_blocks == 2 and big.block_table == []
    assert bm.allocate_blocks(3) is None


def test_prefix_hit_shares_committed_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq("a", list(range(10)))
    bm.allocate(a)
    computed(bm, a)  # blocks 0,1 full and committed
    b = make_seq("b", list(range(8)) + [99, 98, 97])
    assert bm.num_cached_prefix_tokens(b) == 8
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert bm.ref_counts[a.block_table[0]] == 2


def test_no_prefix_hit_on_last_token_block() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq("a", list(range(8)))
    bm.allocate(a)
    computed(bm, a)
    b = make_seq("b", list(range(8)))  # identical prompt: the last block must still be computed
    bm.allocate(b)
    assert b.num_cached_tokens == 4


def test_prefix_survives_free_until_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq("a", list(range(9)))
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = make_seq("b", list(range(9)))
    bm.allocate(b)
    assert b.num_cached_tokens == 8  # revived from the free queue
    bm.free(b)
    # Fill the cache with other content: the old prefix is evicted.
    c = make_seq("c", [1000 + i for i in range(16)])
    bm.allocate(c)
    computed(bm, c)
    bm.free(c)
    d = make_seq("d", list(range(9)))
    assert bm.num_cached_prefix_tokens(d) == 0


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    a = make_seq("a", list(range(10)))
    bm.allocate(a)
    computed(bm, a)
    b = make_seq("b", list(range(10)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert len(a.block_hashes) == 2  # hashes are still computed (used by KV migration)


def test_copy_on_write_after_fork() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq("p", list(range(6)))  # block 0 full, block 1 holds 2 tokens
    bm.allocate(parent)
    parent.num_computed_tokens = 6
    child = make_seq("c", list(range(6)))
    bm.fork(parent, child)
    shared_tail = parent.block_table[1]
    assert bm.ref_counts[shared_tail] == 2
    # The child appends token 7 into the shared, partially filled block: it must get a copy.
    child.token_ids.append(42)
    copies = bm.append_slots(child, 1)
    assert copies is not None and len(copies) == 1
    src, dst = copies[0]
    assert src == shared_tail and dst != shared_tail
    assert child.block_table[1] == dst and parent.block_table[1] == shared_tail
    assert child.block_table[0] == parent.block_table[0]  # full block still shared
    assert bm.ref_counts[shared_tail] == 1
    # The parent now owns its tail alone: no copy.
    parent.token_ids.append(7)
    assert bm.append_slots(parent, 1) == []
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_append_grows_and_says_no() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    s = make_seq("s", list(range(4)))
    bm.allocate(s)
    s.num_computed_tokens = 4
    s.token_ids.append(5)
    assert bm.can_append(s, 1)
    assert bm.append_slots(s, 1) == []
    assert len(s.block_table) == 2
    s.num_computed_tokens = 8
    s.token_ids.extend([1, 2, 3, 4])
    assert not bm.can_append(s, 1)
    assert bm.append_slots(s, 1) is None


def test_hashes_are_chained_and_stable() -> None:
    h1 = prefix_block_hashes(list(range(8)), 4)
    h2 = prefix_block_hashes(list(range(8)), 4)
    h3 = prefix_block_hashes([0, 1, 2, 3, 9, 5, 6, 7], 4)
    h4 = prefix_block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert h1 == h2 and len(h1) == 2
    assert h3[0] == h1[0] and h3[1] != h1[1]
    assert h4[1] != h1[1]  # same block content, different prefix
