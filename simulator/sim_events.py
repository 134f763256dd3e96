"""The kinds of events on a ``Simulation``'s queue, in the order they are handled at one instant.

Steps that end then are applied, then finished prefills migrate, then migrations that complete
then are delivered, then arrivals are routed; instances launch their next step only after all of
that (``Simulation.run``). An event is ``(time, kind, sequence number, payload)`` on a heap: at one
time, kinds go in this order, and events of one kind in the order they were pushed. Arrivals are
not on the heap (they are known in advance, in time order): the loop merges them in, each after
every other event of its instant, ties in the workload's order.
"""

STEP_DONE, MIGRATE, MIGRATED, LAUNCH, ARRIVE = 0, 1, 2, 3, 4
