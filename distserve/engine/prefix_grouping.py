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

from distserve.engine.sequence import Sequence

_block_table = attrgetter("block_table")


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
    for seq, key in zip(running, keys):
        group = groups[key] if key is not None else None
        if group is None or len(group) == 1:
            order.append(seq)
        elif group:  # the group's best-ranked member: the whole group goes here, once
            group.sort(key=_block_table)  # stable: equal tables keep the policy order
            order.extend(group)
            group.clear()
    return order
