"""Prefix groups in batch selection: the order in which the scheduler offers running sequences a step.

Sequences whose first block is the same *physical* block share a prompt prefix (prefix caching
hands every sequence with the same leading tokens the same committed blocks; prefix-aware
migration does the same on a decode instance). Cascade attention (``kernels.cascade_attention``)
reads such a shared prefix once per step for every member in the batch, so a step that cannot take
every running sequence (``max_num_seqs``, the token budget, or a pipeline's micro-batches) should
take whole groups rather than a few members of each.

``group_by_prefix`` reorders the policy order into that selection order: a group's members are
taken one after another at the position of its best-ranked member, sorted by block table so the
sub-groups of a multi-level tree (a document shared by some of a system prompt's users) stay
adjacent too. Groups never cross class ranks (the key holds ``class_rank``), so a lower class is
never taken ahead of a higher one. A first block is shared only once it is full and committed
(the prefix cache never hands out a block still being written); a ``fork``'s shared partial block
is copied on its next write.
"""

from __future__ import annotations

from operator import attrgetter

from distserve.engine.block_manager import BlockManager
from distserve.engine.sequence import Sequence

_block_table = attrgetter("block_table")
_token_ids = attrgetter("token_ids")
_num_computed = attrgetter("num_computed_tokens")


def group_by_prefix(running: list[Sequence]) -> list[Sequence] | None:
    """``running`` (in policy order) with each prefix group together, or None when no two sequences
    of one class share their first block (the policy order is then the selection order). O(n) dict
    work plus a sort of each group's block tables."""
    groups: dict[tuple[int, int], list[Sequence]] = {}
    keys: list[tuple[int, int] | None] = []
    shared = False
    for seq in running:
        table = seq.block_table
        if not table:
            keys.append(None)
            continue
        key = (seq.class_rank, table[0])
        keys.append(key)
        group = groups.get(key)
        if group is None:
            groups[key] = [seq]
        else:
            group.append(seq)
            shared = True
    if not shared:
        return None
    order: list[Sequence] = []
    for seq, key_ in zip(running, keys):
        group = groups[key_] if key_ is not None else None
        if group is None or len(group) == 1:
            order.append(seq)
        elif group:  # the group's best-ranked member: the whole group goes here, once
            group.sort(key=_block_table)  # stable: equal tables keep the policy order
            order.extend(group)
            group.clear()
    return order


class PrefixGrouping:
    """The scheduler's selection order, and the grouping it keeps while ``running`` is unchanged."""

    def __init__(self) -> None:
        self._made_for: list[Sequence] = []  # the running list the grouping was made for
        self._order: list[Sequence] | None = None
        self._excess = 0  # Σ(tokens to compute - 1) over that running list then

    def invalidate(self) -> None:
        """A sequence joined or was preempted: make the grouping anew when next needed. The grouping
        goes too: an empty ``running`` equals the emptied ``_made_for``, and must not get it back."""
        self._made_for = []
        self._order = None

    def selection_order(
        self, running: list[Sequence], num_in_flight: int, budget: int, max_seqs: int, bm: BlockManager
    ) -> list[Sequence]:
        """The order this step offers running sequences: prefix groups together (``group_by_prefix``)
        once more of them could decode than one plan takes, else ``running`` (the policy order).

        The grouping is kept while ``running`` holds the same sequences (so a pipeline's
        micro-batches keep their groups and the loop finds each one's members together); it is
        made anew only when more sequences are not in flight than one plan takes, counted in O(1):
        ``len(running) - num_in_flight`` (at most their number: an id in flight may belong to one
        finished since), one token each (a running prefill chunk takes more, so a budget it
        exhausts keeps the policy order). Everything fitting, the order changes only the chunks'
        order in the plan.

        Preemption takes victims from the tail of the *policy* order, which is only safe while the
        selection follows it too (a victim is then never one already in this plan). So groups are
        used only when no preemption can happen this step. A chunk of n tokens needs at most
        ceil((n - 1) / block_size) + 1 new blocks (a decode one: a new block or a copy-on-write,
        never both), so the step needs at most max_seqs + e // block_size + min(e, max_seqs),
        e = Σ(n - 1) over running (capped by the budget); e only falls while ``running`` holds the
        same sequences (a preempted one leaves it and drops the grouping). With fewer blocks free,
        the policy order stays.
        """
        if self._made_for != running:  # list !=: identity of each element, in C
            if len(running) - num_in_flight <= (max_seqs if max_seqs < budget else budget):
                return running
            self._made_for = running[:]
            self._order = group_by_prefix(running)
            self._excess = sum(map(len, map(_token_ids, running))) - sum(map(_num_computed, running)) - len(running)
        order = self._order
        if order is None:
            return running
        excess = self._excess if self._excess < budget else budget
        needed = max_seqs + excess // bm.block_size + (excess if excess < max_seqs else max_seqs)
        return order if bm.num_free_blocks >= needed else running

