"""The layouts a placement search may try and what bounds them, before any simulation: (tp, pp)
configurations that fit, each phase's steady-state throughput bound, and how a chosen placement is
replicated and pinned to nodes."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from distserve.errors import InvalidConfigError
from distserve.placement import InstanceSpec, Placement
from simulator.latency import BatchShape, LatencyModel
from simulator.sim_config import SimConfig

if TYPE_CHECKING:
    from collections.abc import Sequence

    from distserve.planner.plan import Cluster
    from simulator.workload import Request


def parallel_configs(latency: LatencyModel, cluster: Cluster, mem_utilization: float, max_pp: int | None = None) -> list[tuple[int, int]]:
    """(tp, pp) layouts that the latency model can time and that fit in memory.

    TP stays inside a node (it all-reduces every layer) and divides the heads; PP divides the layers.
    """
    model = latency.model
    out = []
    tp = 1
    while tp <= cluster.gpus_per_node:
        if model.num_heads % tp == 0:
            for pp in range(1, model.num_layers + 1):
                if model.num_layers % pp or tp * pp > cluster.num_gpus or (max_pp is not None and pp > max_pp):
                    continue
                if not latency.supports(tp, pp):
                    continue
                try:
                    latency.max_kv_tokens(tp, pp, mem_utilization)
                except InvalidConfigError:
                    continue
                out.append((tp, pp))
        tp *= 2
    return out


def prefill_bound(latency: LatencyModel, tp: int, pp: int, prompt_mean: float, max_tokens: int) -> float:
    """Requests/s of back-to-back full prefill batches (pipelined: one stage time per batch)."""
    per_batch = max(1, int(max_tokens // max(prompt_mean, 1)))
    n = int(round(prompt_mean))
    t = latency.step_time(BatchShape(per_batch, per_batch * n, per_batch * n * n, 0, 0), tp, pp)
    return per_batch / t if t > 0 else math.inf


def decode_bound(latency: LatencyModel, tp: int, pp: int, prompt_mean: float, output_mean: float, max_seqs: int, kv_tokens: int) -> float:
    """Requests/s of full decode micro-batches back to back (pp in flight, one stage time apart).

    A micro-batch holds at most ``max_seqs`` sequences, and all ``pp`` of them share the KV capacity.
    """
    ctx = prompt_mean + output_mean / 2
    batch = max(1, min(max_seqs, int(kv_tokens // max(ctx * pp, 1))))
    t = latency.step_time(BatchShape(0, 0, 0, batch, int(batch * ctx)), tp, pp)
    return batch / t / max(output_mean, 1.0) if t > 0 else math.inf


def placement_bound(latency: LatencyModel, placement: Placement, requests: Sequence[Request], config: SimConfig) -> float:
    """Requests/s of ``requests``' mix a disaggregated placement sustains at most: its prefill
    instances' bound or its decode pools', whichever is lower.

    Decode is bounded class by class (each class's lengths, so a mix is not bounded at its mean
    lengths): a pool whose instances decode class c at D(c) requests/s in all, serving the classes
    C at mix fractions f_c, sustains a mix rate of 1 / sum_c f_c / D(c). A class pool
    (``InstanceSpec.pool``) serves its objective, the shared pool the objectives without a pool;
    each instance batches up to its own cap."""
    def mean(values: list[int]) -> float:
        return sum(values) / len(values)

    pre = sum(prefill_bound(latency, s.tp, s.pp, mean([r.prompt_len for r in requests]), config.prefill_scheduler.max_num_batched_tokens)
              for s in placement.prefill) / config.prefill_scale
    pools = {s.pool for s in placement.decode}
    by_class: dict[str, list[Request]] = {}
    for r in requests:
        by_class.setdefault(r.objective, []).append(r)
    bounds = [pre]
    for pool in pools:
        seconds = 0.0  # decode seconds of the pool per request of the mix
        for objective, reqs in by_class.items():
            if objective != pool and (pool is not None or objective in pools):
                continue
            prompt, output = mean([r.prompt_len for r in reqs]), mean([r.output_len for r in reqs])
            rate = sum(decode_bound(latency, s.tp, s.pp, prompt, output, s.scheduler_config(config.decode_scheduler).max_num_seqs,
                                    latency.max_kv_tokens(s.tp, s.pp, config.mem_utilization))
                       for s in placement.decode if s.pool == pool) / config.step_time_scale
            seconds += len(reqs) / len(requests) / rate
        if seconds > 0:
            bounds.append(1.0 / seconds)
    return min(bounds)


def replicate_units(unit: Placement, k: int, pp: int) -> Placement:
    """k copies of a low-affinity unit; copy j uses nodes [j*pp, (j+1)*pp) (stage i on node j*pp+i)."""
    prefill, decode = [], []
    for j in range(k):
        node = j * pp if pp == 1 else None  # a multi-node pipeline is spread by Ray over its nodes
        prefill += [replace(s, node=node) for s in unit.prefill]
        decode += [replace(s, node=node) for s in unit.decode]
    return Placement(prefill=tuple(prefill), decode=tuple(decode))


def assign_nodes(placement: Placement, cluster: Cluster) -> Placement:
    """Pin single-node instances to nodes, first-fit by size (largest first), decode after prefill.

    Instances larger than a node (pp across nodes) stay unpinned (``node`` None): Ray spreads them.
    """
    free = [cluster.gpus_per_node] * cluster.num_nodes
    out: dict[str, list[InstanceSpec]] = {"prefill": [], "decode": [], "colocated": []}
    order = sorted(
        ((kind, i, s) for kind in out for i, s in enumerate(getattr(placement, kind))),
        key=lambda t: -t[2].num_workers,
    )
    assigned: dict[tuple[str, int], InstanceSpec] = {}
    for kind, i, s in order:
        node = None
        if s.num_workers <= cluster.gpus_per_node:
            node = next((n for n, f in enumerate(free) if f >= s.num_workers), None)
            if node is not None:
                free[node] -= s.num_workers
        assigned[(kind, i)] = replace(s, node=node)
    for kind in out:
        out[kind] = [assigned[(kind, i)] for i in range(len(getattr(placement, kind)))]
    return Placement(prefill=tuple(out["prefill"]), decode=tuple(out["decode"]), colocated=tuple(out["colocated"]))
