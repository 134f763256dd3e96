"""Paged KV-cache bookkeeping: block free list, ref counts, prefix reuse by content hash, copy-on-write.

Only ids move here; the tensors live in the model runner. A full block whose KV has been computed
is *committed*: it gets a content hash (chained with its prefix's hash) so later requests with the
same prefix reuse it. A block with ref count 0 stays hashed in the free queue until it is evicted
(least recently freed first), so prefixes survive their requests.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from distserve.engine.sequence import Sequence


_EMPTY_BLAKE2B = hashlib.blake2b(digest_size=8)  # copying it is cheaper than a new hasher


def hash_block(prefix_hash: int | None, token_ids: Seq[int]) -> int:
    """Stable 63-bit content hash of a full block, chained to the hash of the blocks before it."""
    h = _EMPTY_BLAKE2B.copy()
    h.update((prefix_hash if prefix_hash is not None else -1).to_bytes(8, "little", signed=True))
    h.update(array("q", token_ids))
    return int.from_bytes(h.digest(), "little") >> 1


def prefix_block_hashes(token_ids: Seq[int], block_size: int) -> list[int]:
    """Hashes of every full block of ``token_ids``."""
    hashes: list[int] = []
    prev: int | None = None
    for i in range(len(token_ids) // block_size):
        prev = hash_block(prev, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(prev)
    return hashes


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    content_hash: int | None = None
    token_ids: list[int] = field(default_factory=list)  # content of a hashed block, to rule out collisions


class BlockManager:
    """Allocates fixed-size KV blocks to sequences. Methods that can fail say no by returning False/None."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self.num_prefix_hit_tokens = 0
        self.num_prefix_query_tokens = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences."""
        return 1.0 - len(self._free) / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_block(self, content_hash: int) -> int | None:
        """Id of a block holding this content hash (live or evictable), if any."""
        return self._hash_to_block.get(content_hash)

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Ids of cached blocks covering the longest prefix of ``seq`` (never its last token)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        prev: int | None = None
        bs = self.block_size
        # The last token must be computed to produce logits, so its block is never a hit.
        for i in range((seq.num_tokens - 1) // bs):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            prev = hash_block(prev, tokens)
            block_id = self._hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` that admission would take from the prefix cache."""
        return len(self._match_prefix(seq)) * self.block_size

    # ---- allocation ----------------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._match_prefix(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.num_blocks_for(seq.num_tokens) - len(hits) + revived <= len(self._free)

    def allocate(self, seq: Sequence) -> bool:
        """Give ``seq`` blocks for all its tokens, reusing cached prefix blocks. False if it doesn't fit."""
        assert not seq.block_table, f"{seq.seq_id} already holds blocks"
        if not self.can_allocate(seq):
            return False
        hits = self._match_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        seq.block_table = hits + [self._take_free_block() for _ in range(self.num_blocks_for(seq.num_tokens) - len(hits))]
        seq.block_hashes = [self.blocks[b].content_hash for b in hits]  # type: ignore[misc]
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        self.num_prefix_hit_tokens += seq.num_cached_tokens
        self.num_prefix_query_tokens += seq.num_tokens
        return True

    def allocate_blocks(self, num_blocks: int) -> list[int] | None:
        """Raw blocks for a caller that fills them itself (e.g. KV received from another instance)."""
        if num_blocks > len(self._free):
            return None
        return [self._take_free_block() for _ in range(num_blocks)]

    def _slots_needed(self, seq: Sequence, num_new_tokens: int) -> tuple[int, bool]:
        """(new blocks to add, whether the block receiving the first new token must be copied)."""
        bs = self.block_size
        computed = seq.num_computed_tokens
        table = seq.block_table
        grow = (computed + num_new_tokens + bs - 1) // bs - len(table)
        first = computed // bs
        cow = first < len(table) and self.blocks[table[first]].ref_count > 1
        return (grow if grow > 0 else 0), cow

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        grow, cow = self._slots_needed(seq, num_new_tokens)
        return grow + int(cow) <= len(self._free)

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
        cow = first < num_held and self.blocks[table[first]].ref_count > 1
        if grow <= 0:
            if not cow:
                return []  # the common decode step: room in the last block, nothing shared
            grow = 0
        if grow + cow > len(self._free):
            return None
        copies: list[tuple[int, int]] = []
        if cow:
            src = table[first]
            dst = self._take_free_block()
            self.blocks[src].ref_count -= 1
            table[first] = dst
            copies.append((src, dst))
        if grow == 1:
            table.append(self._take_free_block())
        elif grow:
            table.extend([self._take_free_block() for _ in range(grow)])
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
        while len(hashes) < num_full:
            i = len(hashes)
            prev = hashes[-1] if hashes else None
            tokens = token_ids[i * bs : (i + 1) * bs]
            h = hash_block(prev, tokens)
            hashes.append(h)
            if not self.enable_prefix_caching:
                continue
            block = self.blocks[seq.block_table[i]]
            if h not in self._hash_to_block and block.content_hash is None:
                block.content_hash = h
                block.token_ids = list(tokens)
                self._hash_to_block[h] = block.block_id

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share every block of ``parent`` with ``child`` (copy-on-write on the next append)."""
        assert not child.block_table
        for b in parent.block_table:
            self.blocks[b].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks; hashed ones stay reusable until evicted."""
        blocks, free = self.blocks, self._free
        for b in reversed(seq.block_table):  # free_block inlined: one call per block adds up
            block = blocks[b]
            assert block.ref_count > 0, f"double free of block {b}"
            block.ref_count -= 1
            if block.ref_count == 0:
                free[b] = None
        seq.block_table = []
        seq.block_hashes = []

    def free_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of block {block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.content_hash is not None:
            if self._hash_to_block.get(block.content_hash) == block_id:
                del self._hash_to_block[block.content_hash]
            block.content_hash = None
            block.token_ids = []
        block.ref_count = 1
        return block_id
