"""Deploying a placement on Ray: placement groups, instance actors, their workers and the torch.distributed world.

Each instance is a threaded Ray actor (``InstanceServer``) in a placement group of its own
(STRICT_PACK, one bundle per worker, on the node the placement names). All workers of all
instances form one torch.distributed world (gloo on CPU, NCCL on GPU): TP/PP groups inside an
instance, point-to-point KV migration between them. ``DeployedInstance`` is what the controller
knows about one of them; ``deploy`` creates them all, ``open_rendezvous`` opens a fresh rendezvous for
the world (formed again after a restart, see ``runtime.recovery``), and ``undeploy`` removes them.
A decode instance of a class pool runs with its spec's batch cap and routes by its pool
(``InstanceSpec.pool``/``max_num_seqs``, kept in its ``RouteState``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distserve.cluster.routing import RouteState
from distserve.engine.frontend import RequestFrontend
from distserve.engine.sequence import Sequence
from distserve.errors import InvalidConfigError
from distserve.kvtransfer.layout import KVLayout
from distserve.placement import InstanceSpec, Placement
from distserve.runtime.config import DeploymentConfig
from distserve.runtime.instance_protocol import InstanceServerSpec, StepResult
from distserve.runtime.instance_server import InstanceServer
from distserve.runtime.ray_env import ACTOR_TASK_EVENTS

if TYPE_CHECKING:
    from distserve.runtime.worker import WorkerSpec

CPUS_PER_WORKER = 0.1  # Ray bookkeeping only: on 2 cores, the OS shares the cores among workers.
PLACEMENT_GROUP_TIMEOUT_S = 120.0


class RayWorkerFactory:
    """Creates a worker actor in its bundle of the instance's placement group (picklable)."""

    def __init__(self, placement_group: Any) -> None:
        self.placement_group = placement_group

    def __call__(self, spec: WorkerSpec) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from distserve.runtime.worker import Worker  # (called in the instance's process: the controller never loads torch)

        strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=spec.shard.rank)
        return (
            ray.remote(Worker)
            # Threads: one per plan waiting its turn (up to pp), plus transfers, polls and control calls.
            .options(num_cpus=CPUS_PER_WORKER, max_concurrency=spec.shard.pp + 4, scheduling_strategy=strategy, **ACTOR_TASK_EVENTS)
            .remote(spec)
        )


@dataclass
class DeployedInstance:
    """One instance of the deployment as the controller sees it: its actor, and its loop's and routing's state."""

    spec: InstanceServerSpec
    actor: Any
    placement_group: Any
    layout: KVLayout | None = None
    has_work: bool = False
    kicked: bool = False  # work arrived while a step was in flight: step again
    alive: bool = True
    restarting: bool = False  # dead, and a replacement is being started
    restarts: int = 0
    charged_restarts: int = 0  # of its deaths, those counted against max_instance_restarts (poison's are not)
    solo_pending: dict[str, float] = field(default_factory=dict)  # suspects here before their step alone -> arrival
    solo_queue: list[Sequence] = field(default_factory=list)  # suspects placed here, sent by its loop between steps
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    route: RouteState = field(default_factory=RouteState)  # what routing knows (``cluster.routing``)
    last_step: StepResult | None = None  # its latest step's result (admission reads its load), None since (re)start
    num_added: int = 0  # requests sent to its actor's ``add`` since (re)start: those beyond last_step.num_added are unseen
    unseen: list[tuple[int, int, int]] = field(default_factory=list)  # (add number, admission rank, prompt tokens) not yet in a step result

    @property
    def phase(self) -> str:
        return self.spec.phase

    @property
    def instance_id(self) -> str:
        return self.spec.instance_id

    def kick(self) -> None:
        self.has_work = True
        self.kicked = True
        self.wake.set()


def route_of(inst: DeployedInstance) -> RouteState:
    """The routing state of an instance (the key ``cluster.routing`` reads)."""
    return inst.route


async def deploy(config: DeploymentConfig, frontend: RequestFrontend, dtype: str) -> tuple[list[DeployedInstance], int]:
    """Create every instance's placement group and actor; returns them and the world size.

    ``frontend`` (the controller) holds the resolved cache and scheduler configs and the model's
    limits. The actors are created, not yet initialized: the caller joins them into the world with
    ``open_rendezvous`` (their ``init``) once all are up.
    """
    from ray.util.placement_group import placement_group

    placement = config.placement
    groups: list[tuple[str, tuple[InstanceSpec, ...]]] = [
        ("prefill", placement.prefill), ("decode", placement.decode), ("colocated", placement.colocated)
    ]
    instances: list[DeployedInstance] = []
    next_rank = 0
    for phase, placed_specs in groups:
        sched = (config.prefill_scheduler_config if phase == "prefill" else None) or frontend.scheduler_config
        for i, placed in enumerate(placed_specs):
            world = placed.num_workers
            bundle = {"CPU": CPUS_PER_WORKER, **_node_resources(placed.node)}
            pg = placement_group([dict(bundle) for _ in range(world)], strategy="STRICT_PACK")
            spec = InstanceServerSpec(
                instance_id=f"{phase}-{i}", phase=phase, model=config.model, dtype=dtype,
                cache=frontend.cache_config, scheduler=placed.scheduler_config(sched), num_blocks=frontend.num_blocks,
                max_model_len=frontend.max_model_len, eos_token_ids=frontend.eos_token_ids, tp=placed.tp, pp=placed.pp,
                global_ranks=list(range(next_rank, next_rank + world)),
                num_threads=placed.threads or config.num_threads_per_worker or 1,
                kv_transfer_timeout_s=config.kv_transfer_timeout_s,
            )
            next_rank += world
            instances.append(DeployedInstance(spec, None, pg, route=RouteState(pool=placed.pool)))
    await asyncio.gather(*(asyncio.wrap_future(_ready_future(inst.placement_group)) for inst in instances))
    for inst in instances:
        inst.actor = create_instance_actor(inst)
    return instances, next_rank


async def open_rendezvous(instances: list[DeployedInstance], placement: Placement, world_size: int) -> str:
    """A fresh rendezvous for the world about to form (each ``init``/``reinit`` joins it): global rank 0's
    store, bound by that rank to a port the OS picks (on 127.0.0.1 when every instance runs on one node)."""
    placed = placement.prefill + placement.decode + placement.colocated
    first = next(i for i in instances if i.spec.global_ranks[0] == 0)
    return await first.actor.open_rendezvous.remote(world_size, all(p.node in (None, 0) for p in placed))


def create_instance_actor(inst: DeployedInstance) -> Any:
    """The instance's actor, in bundle 0 of its placement group; it creates its other ranks."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(inst.placement_group, placement_group_bundle_index=0)
    return (
        ray.remote(InstanceServer)
        .options(num_cpus=CPUS_PER_WORKER, max_concurrency=8, max_restarts=0, scheduling_strategy=strategy, **ACTOR_TASK_EVENTS)
        .remote(inst.spec, RayWorkerFactory(inst.placement_group))
    )


async def undeploy(instances: list[DeployedInstance]) -> None:
    """Shut down and kill every instance actor and remove every placement group (also of actors that never started)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for inst in instances:
        if inst.actor is not None:
            if inst.alive:
                try:
                    await asyncio.wait_for(inst.actor.shutdown.remote(), timeout=10)
                except Exception:  # noqa: BLE001 - best effort: the actor is killed below anyway
                    pass
            ray.kill(inst.actor, no_restart=True)
        remove_placement_group(inst.placement_group)


def _node_resources(node_index: int | None) -> dict[str, float]:
    """Bundle resources pinning a worker to the placement's node ``node_index``.

    A cluster may label its nodes with ``distserve_node_<i>`` custom resources; otherwise node i
    is the i-th alive Ray node by node id, addressed through Ray's built-in ``node:<ip>`` resource.
    """
    if node_index is None:
        return {}
    import ray

    label = f"distserve_node_{node_index}"
    if label in ray.cluster_resources():
        return {label: 0.001}
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeID"])
    if node_index >= len(nodes):
        raise InvalidConfigError(f"placement names node {node_index} but the Ray cluster has {len(nodes)} node(s)")
    return {f"node:{nodes[node_index]['NodeManagerAddress']}": 0.001}


def _ready_future(pg: Any) -> concurrent.futures.Future[Any]:
    """Resolves when the placement group is placed; an ``InvalidConfigError`` if the cluster cannot host it."""
    import ray

    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def wait() -> None:
        try:
            fut.set_result(ray.get(pg.ready(), timeout=PLACEMENT_GROUP_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - surfaced to the caller through the future
            fut.set_exception(
                InvalidConfigError(f"the cluster cannot host this placement (placement group not ready: {exc})")
            )

    threading.Thread(target=wait, daemon=True).start()
    return fut
