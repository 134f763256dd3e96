"""Paged KV-cache bookkeeping: block free list, ref counts, prefix reuse by content hash, copy-on-write.

Only ids move here; the tensors live in the model runner. A full block whose KV has been computed
is *committed*: it gets a content hash (chained with its prefix's hash) so later requests with the
same prefix reuse it. A block with ref count 0 stays hashed in the free queue until it is evicted
(least recently freed first), so prefixes survive their requests.

A full block a live sequence has been given to fill (admitted, KV not computed or received yet) is
*in flight*: the block manager remembers its content hash and who fills it until that sequence
commits it or lets go of its blocks (finished, aborted, preempted, failed). The scheduler asks
``num_blocks_in_flight`` before admitting a prompt, so siblings that share a prefix and arrive
together compute it once: the first computes, the others wait for its commit and then hit the cache.

A sequence's block hashes are computed once and kept on it (``seq_block_hashes``): admission
(``can_allocate``, ``num_cached_prefix_tokens``, ``allocate``, each asked again every step a
prompt waits), ``commit`` and prefix-affinity routing all read the same list. It never goes stale
because ``token_ids`` only grow (preemption and crash re-runs keep the tokens so far), and a
block's hash depends only on the tokens up to its end.

A block is a ref count in a list (``ref_counts``), and a content hash and its tokens in two dicts
once it is hashed; it comes into being on first use: a simulation builds thousands of block
managers (one per instance per probe), and takes blocks by the million. The free order is the one
of a queue that starts as ``0 .. num_blocks - 1``: never-used blocks (ids ``>= len(ref_counts)``,
taken in id order) come first, then the freed ones, least recently freed first. The freed ones are a
log, appended to on free and read from its head on take, so a run of them is taken as one slice; a
prefix hit that revives a freed block leaves its entry behind, skipped when the head reaches it
(``_num_stale``: a block's stale entries are always its earliest, as a revival invalidates its latest).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence as Seq

from distserve.engine.sequence import Sequence


_EMPTY_BLAKE2B = hashlib.blake2b(digest_size=8)  # copying it is cheaper than a new hasher


def _computes_whole_prompt(seq: Sequence) -> bool:
    """A prompt whose logprobs were asked for is computed whole: a cached block has no logits (as vLLM,
    such a request takes no prefix-cache hits; it still publishes its blocks for others)."""
    return seq.sampling.prompt_logprobs is not None and seq.num_tokens == seq.num_prompt_tokens


def hash_block(prefix_hash: int | None, token_ids: Seq[int]) -> int:
    """Stable 63-bit content hash of a full block, chained to the hash of the blocks before it."""
    h = _EMPTY_BLAKE2B.copy()
    h.update((prefix_hash if prefix_hash is not None else -1).to_bytes(8, "little", signed=True))
    h.update(array("q", token_ids))
    return int.from_bytes(h.digest(), "little") >> 1


def prefix_block_hashes(token_ids: Seq[int], block_size: int) -> list[int]:
    """Hashes of every full block of ``token_ids``."""
    return _extend_hashes([], token_ids, block_size, len(token_ids) // block_size)


def seq_block_hashes(seq: Sequence, block_size: int, num_blocks: int | None = None) -> list[int]:
    """Hashes of the first ``num_blocks`` full blocks of ``seq.token_ids`` (all of them if None),
    as ``prefix_block_hashes`` computes them, each block hashed once in the sequence's lifetime."""
    n = seq.num_tokens // block_size if num_blocks is None else num_blocks
    return _hashes_upto(seq, block_size, n)[:n]


def _hashes_upto(seq: Sequence, block_size: int, num_blocks: int) -> list[int]:
    """``seq``'s hash cache itself, extended to cover at least ``num_blocks`` blocks: read it, don't keep it."""
    if seq.hashed_block_size != block_size:  # never hashed, or for another block size: start over
        seq.prefix_hashes = []
        seq.hashed_block_size = block_size
    cache = seq.prefix_hashes
    return cache if len(cache) >= num_blocks else _extend_hashes(cache, seq.token_ids, block_size, num_blocks)


def _extend_hashes(hashes: list[int], token_ids: Seq[int], block_size: int, num_blocks: int) -> list[int]:
    """Append to ``hashes`` (the chained hashes of the leading blocks of ``token_ids``) up to ``num_blocks``."""
    prev = hashes[-1] if hashes else None
    for i in range(len(hashes), num_blocks):
        prev = hash_block(prev, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(prev)
    return hashes


class BlockManager:
    """Allocates fixed-size KV blocks to sequences. Methods that can fail say no by returning False/None."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts: list[int] = []  # of each block used so far (block i exists once taken: i < len)
        self._block_hash: dict[int, int] = {}  # block -> its content hash, for the hashed blocks
        self._block_tokens: dict[int, list[int]] = {}  # block -> its content, to rule out hash collisions
        # Freed blocks, least recently freed first: ``_free_log[_free_head:]`` less the stale entries.
        self._free_log: list[int] = []
        self._free_head = 0
        self._num_freed = 0  # valid entries in the log: blocks with ref count 0
        self._num_stale: dict[int, int] = {}  # block -> its entries in the log left by revivals
        self._hash_to_block: dict[int, int] = {}
        self.num_prefix_hit_tokens = 0
        self.num_prefix_query_tokens = 0
        # Content hash of each in-flight full block -> the sequence filling it (the first to be given it).
        self._in_flight: dict[int, Sequence] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - len(self.ref_counts) + self._num_freed

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_block(self, content_hash: int) -> int | None:
        """Id of a block holding this content hash (live or evictable), if any."""
        return self._hash_to_block.get(content_hash)

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Ids of cached blocks covering the longest prefix of ``seq`` (never its last token)."""
        if not self.enable_prefix_caching or _computes_whole_prompt(seq):
            return []
        hits: list[int] = []
        bs = self.block_size
        # The last token must be computed to produce logits, so its block is never a hit.
        num_candidates = (seq.num_tokens - 1) // bs
        hashes = _hashes_upto(seq, bs, num_candidates)
        token_ids = seq.token_ids
        for i in range(num_candidates):
            block_id = self._hash_to_block.get(hashes[i])
            if block_id is None or self._block_tokens[block_id] != token_ids[i * bs : (i + 1) * bs]:
                break
            hits.append(block_id)
        return hits

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` that admission would take from the prefix cache."""
        return len(self._match_prefix(seq)) * self.block_size

    def num_blocks_in_flight(self, seq: Sequence) -> int:
        """Leading full blocks of ``seq`` past its cached prefix that another live sequence here is
        filling right now: admitting ``seq`` now would compute them a second time."""
        in_flight = self._in_flight
        if not in_flight or _computes_whole_prompt(seq):
            return 0
        num_hits = len(self._match_prefix(seq))  # also hashes every candidate block
        hashes = seq.prefix_hashes
        n = 0
        for i in range(num_hits, (seq.num_tokens - 1) // self.block_size):
            holder = in_flight.get(hashes[i])
            if holder is None or holder is seq:
                break
            n += 1
        return n

    # ---- allocation ----------------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        """Room for ``seq``'s blocks, and for one more block per completion forked from it (``n`` > 1:
        each completion's first token copies the shared last block, or opens a new one)."""
        hits = self._match_prefix(seq)
        ref_counts = self.ref_counts
        revived = sum(1 for b in hits if ref_counts[b] == 0)
        return self.num_blocks_for(seq.num_tokens) - len(hits) + revived + len(seq.forks) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> bool:
        """Give ``seq`` blocks for all its tokens, reusing cached prefix blocks. False if it doesn't fit."""
        assert not seq.block_table, f"{seq.seq_id} already holds blocks"
        if not self.can_allocate(seq):
            return False
        hits = self._match_prefix(seq)
        ref_counts = self.ref_counts
        for block_id in hits:
            if ref_counts[block_id] == 0:  # revived: its entry in the free log goes stale
                self._num_stale[block_id] = self._num_stale.get(block_id, 0) + 1
                self._num_freed -= 1
            ref_counts[block_id] += 1
        seq.block_table = hits + self._take_free_blocks(self.num_blocks_for(seq.num_tokens) - len(hits))
        seq.block_hashes = [self._block_hash[b] for b in hits]
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        self.num_prefix_hit_tokens += seq.num_cached_tokens
        self.num_prefix_query_tokens += seq.num_tokens
        if self.enable_prefix_caching:
            self._mark_in_flight(seq, len(hits))
        return True

    def _mark_in_flight(self, seq: Sequence, num_hits: int) -> None:
        """``seq`` fills its full blocks past the first ``num_hits``: each is in flight until committed."""
        num_full = seq.num_tokens // self.block_size
        in_flight, cached = self._in_flight, self._hash_to_block
        for h in _hashes_upto(seq, self.block_size, num_full)[num_hits:num_full]:
            if h not in in_flight and h not in cached:
                in_flight[h] = seq

    def _drop_in_flight(self, seq: Sequence) -> None:
        """``seq`` lets go of its blocks: the ones it was filling and had not committed are no longer in flight."""
        in_flight = self._in_flight
        hashes = seq.prefix_hashes if seq.hashed_block_size == self.block_size else ()
        for h in hashes[len(seq.block_hashes) :]:
            if in_flight.get(h) is seq:
                del in_flight[h]

    def allocate_blocks(self, num_blocks: int) -> list[int] | None:
        """Raw blocks for a caller that fills them itself (e.g. KV received from another instance)."""
        if num_blocks > self.num_blocks - len(self.ref_counts) + self._num_freed:  # (num_free_blocks)
            return None
        return self._take_free_blocks(num_blocks)

    def _slots_needed(self, seq: Sequence, num_new_tokens: int) -> tuple[int, bool]:
        """(new blocks to add, whether the block receiving the first new token must be copied)."""
        bs = self.block_size
        computed = seq.num_computed_tokens
        table = seq.block_table
        grow = (computed + num_new_tokens + bs - 1) // bs - len(table)
        first = computed // bs
        cow = first < len(table) and self.ref_counts[table[first]] > 1
        return (grow if grow > 0 else 0), cow

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        grow, cow = self._slots_needed(seq, num_new_tokens)
        return grow + int(cow) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> list[tuple[int, int]] | None:
        """Make room for the next ``num_new_tokens`` KV entries of ``seq``.

        Returns the (src, dst) block copies the runner must do first (copy-on-write of a shared
        partially-filled block), or None if there are not enough free blocks.
        """
        # _slots_needed inlined: this runs for every scheduled sequence of every step.
        bs = self.block_size
        computed = seq.num_computed_tokens
        table = seq.block_table
        num_held = len(table)
        grow = (computed + num_new_tokens + bs - 1) // bs - num_held
        first = computed // bs
        cow = first < num_held and self.ref_counts[table[first]] > 1
        if grow <= 0:
            if not cow:
                return []  # the common decode step: room in the last block, nothing shared
            grow = 0
        if grow + cow > self.num_blocks - len(self.ref_counts) + self._num_freed:
            return None
        copies: list[tuple[int, int]] = []
        if cow:
            src = table[first]
            dst = self._take_free_block()
            self.ref_counts[src] -= 1
            table[first] = dst
            copies.append((src, dst))
        if grow == 1:
            table.append(self._take_free_block())
        elif grow:
            table.extend(self._take_free_blocks(grow))
        return copies

    def commit(self, seq: Sequence) -> None:
        """Hash the full blocks whose KV is now computed so later requests can reuse them."""
        bs = self.block_size
        token_ids = seq.token_ids
        computed = seq.num_computed_tokens
        num_full = (computed if computed < len(token_ids) else len(token_ids)) // bs
        hashes = seq.block_hashes
        if len(hashes) >= num_full:
            return  # no block filled up since the last commit (every decode step but one per block)
        content = _hashes_upto(seq, bs, num_full)
        if not self.enable_prefix_caching:  # nothing to publish: the hashes only
            hashes.extend(content[len(hashes):num_full])
            return
        while len(hashes) < num_full:
            i = len(hashes)
            h = content[i]
            hashes.append(h)
            if self._in_flight.get(h) is seq:
                del self._in_flight[h]
            block_id = seq.block_table[i]
            if h not in self._hash_to_block and block_id not in self._block_hash:
                self._block_hash[block_id] = h
                self._block_tokens[block_id] = token_ids[i * bs : (i + 1) * bs]
                self._hash_to_block[h] = block_id

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share every block of ``parent`` with ``child`` (copy-on-write on the next append): the blocks
        hold the same KV, so neither recomputes it; a partly filled block is copied by whichever of
        them appends to it while it is shared (``append_slots``)."""
        assert not child.block_table
        ref_counts = self.ref_counts
        for b in parent.block_table:
            ref_counts[b] += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks; hashed ones stay reusable until evicted."""
        if self._in_flight:
            self._drop_in_flight(seq)
        ref_counts, log = self.ref_counts, self._free_log
        num_logged = len(log)
        append = log.append
        for b in reversed(seq.block_table):  # free_block inlined: one call per block adds up
            if ref_counts[b] == 1:  # (the common case first)
                ref_counts[b] = 0
                append(b)
            else:
                n = ref_counts[b]
                assert n > 0, f"double free of block {b}"
                ref_counts[b] = n - 1
        self._num_freed += len(log) - num_logged
        seq.block_table = []
        seq.block_hashes = []

    def free_block(self, block_id: int) -> None:
        n = self.ref_counts[block_id]
        assert n > 0, f"double free of block {block_id}"
        self.ref_counts[block_id] = n - 1
        if n == 1:
            self._free_log.append(block_id)
            self._num_freed += 1

    def _take_free_block(self) -> int:
        ref_counts = self.ref_counts
        block_id = len(ref_counts)
        if block_id < self.num_blocks:  # a never-used block: first in the free order
            ref_counts.append(1)
            return block_id
        return self._take_freed(1)[0]

    def _take_freed(self, num_blocks: int) -> list[int]:
        """The ``num_blocks`` least recently freed blocks (the caller checked there are), taken."""
        log, head, stale = self._free_log, self._free_head, self._num_stale
        if not stale:  # no stale entry: the next ones in the log, as they are
            end = head + num_blocks
            taken = log[head:end]
        else:
            taken = []
            end = head
            while len(taken) < num_blocks:
                block_id = log[end]
                end += 1
                left = stale.get(block_id)
                if left is None:
                    taken.append(block_id)
                elif left == 1:
                    del stale[block_id]
                else:
                    stale[block_id] = left - 1
        if end > 4096 and 2 * end > len(log):  # drop the read part now and then (amortised O(1) a block)
            del log[:end]
            end = 0
        self._free_head = end
        self._num_freed -= num_blocks
        ref_counts = self.ref_counts
        if self._block_hash:
            for block_id in taken:
                self._evict(block_id)
                ref_counts[block_id] = 1
        else:
            for block_id in taken:
                ref_counts[block_id] = 1
        return taken

    def _evict(self, block_id: int) -> None:
        """A freed block handed out again leaves the prefix cache, if it was in it."""
        h = self._block_hash.pop(block_id, None)
        if h is not None:
            if self._hash_to_block.get(h) == block_id:
                del self._hash_to_block[h]
            del self._block_tokens[block_id]

    def _take_free_blocks(self, num_blocks: int) -> list[int]:
        """``num_blocks`` ``_take_free_block``s, in order (never-used blocks in one go)."""
        ref_counts = self.ref_counts
        first = len(ref_counts)
        new = min(num_blocks, self.num_blocks - first)
        if new <= 0:
            return self._take_freed(num_blocks) if num_blocks > 0 else []
        ref_counts.extend([1] * new)
        taken = list(range(first, first + new))
        if num_blocks > new:  # then freed ones, least recently freed first
            taken += self._take_freed(num_blocks - new)
        return taken
