"""Prefill that yields between layers: a backlogged tenant's long prompt does not hold up a sparse one's.

Fair queueing (``cluster.fair_queue``) gives a sparse tenant's request a lower admission rank than a
backlogged tenant's, and the scheduler puts it first (``engine.rank_order``) — but only from the next
step on. On a CPU a step that prefills a long prompt, or even one chunk of it, takes as long as the
chat request's whole time to first token, so waiting for the step in flight doubles it.

``PreemptibleSteps`` drives one prefill instance's plans a layer at a time (``ModelRunner.begin`` /
``run``). A plan whose prompts rank above 0 asks, after each layer, whether to yield
(``should_yield``: the Ray instance sets it when a request of a lower rank arrives; the in-process
engine when a command waits for its thread). Then the step returns with the plan suspended; the
next step runs a plan of the waiting prompts that rank lower, whole, if there are any (the
scheduler plans around the suspended plan's sequences as it does around a pipeline's micro-batches),
and otherwise resumes the suspended plan where it stopped. Nothing is computed twice: the suspended
plan's KV and hidden states stay as they are. The preempting plan's sequences count against
``max_num_seqs`` with the suspended plan's. Plans of rank 0 (every plan under ``fcfs``, a sparse
tenant's, an interactive tier's) run whole and never yield.

Used by ``runtime.local_disagg.LocalInstance`` and, for an instance of one worker (tp = pp = 1),
by the Ray ``InstanceServer``; ``SchedulerConfig.layer_preemption`` turns it off. The simulator
drives the same object (``take`` / ``settle``) with per-layer step times (``simulator.layer_preemption``).

``within_instance=False`` (the in-process engine's decode instances, which share one thread with
its prefill instances): every plan yields when asked, whatever its rank, and resumes at the next
step — so a chat request that arrives during a long decode step of a flood's batch is prefilled
after the current layer, not after the whole step.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distserve.engine.instance_core import InstanceCore, PlanInFlight
from distserve.engine.sequence import Sequence
from distserve.engine.step_plan import SampledToken, StepPlan, attributed_to

if TYPE_CHECKING:  # torch: the simulator drives this module without a model
    from distserve.engine.model_runner import LayerPass

Begin = Callable[[StepPlan], "LayerPass"]
Run = Callable[["LayerPass", "Callable[[], bool] | None"], "list[SampledToken] | None"]


@dataclass
class PlanPart:
    """A launched plan computed a layer at a time: where it stopped, and its rank."""

    launched: PlanInFlight
    layers: LayerPass | None  # ``begin``'s, set when the part is fresh
    rank: int  # the lowest admission rank of the plan's prompts: a waiting prompt below it preempts
    seconds: float = 0.0  # computing so far (the step budget learns the plan's whole time)


def plan_rank(core: InstanceCore, plan: StepPlan) -> int:
    """The lowest admission rank of the requests ``plan`` computes (0 for an empty plan)."""
    seqs = core.seqs
    ranks = [seqs[c.seq_id].admission_rank for c in plan.chunks if c.seq_id in seqs]
    return min(ranks, default=0)


class PreemptibleSteps:
    """One instance's steps, a plan of a backlogged rank yielding between layers to lower ranks.

    ``guard`` is held around every use of the core (a driver whose requests arrive on other threads
    passes its lock), never while the model computes.
    """

    def __init__(
        self, core: InstanceCore, begin: Begin, run: Run, clock: Callable[[], float],
        guard: AbstractContextManager[Any] | None = None, within_instance: bool = True, send_finished: bool = True,
    ) -> None:
        self.core = core
        self.send_finished = send_finished  # ``InstanceCore.launch``'s: False for a driver without per-request worker state
        self.within_instance = within_instance  # False: yield to other instances, any rank, no preempting plan here
        self.begin, self.run, self.clock = begin, run, clock
        self.guard = guard if guard is not None else nullcontext()
        self._suspended: PlanPart | None = None
        self.running_rank: int | None = None  # of the plan started and not finished: a lower rank arriving should make it yield
        self.last_num_batched_tokens = 0  # tokens of the plan the last step worked on
        self.num_yields = 0  # plans that stopped between layers
        self.num_preemptions = 0  # plans of a lower rank that ran while another was suspended

    @property
    def suspended(self) -> bool:
        return self._suspended is not None

    def step(self, should_yield: Callable[[], bool] | None = None) -> list[Sequence]:
        """Run (part of) one plan; the sequences that received a token, as ``InstanceCore.step``."""
        with self.guard:
            taken = self.take(should_yield)
        if taken is None:
            return []
        s, fresh, should_yield = taken
        plan = s.launched.plan
        t0 = self.clock()
        try:
            with attributed_to(plan):
                if fresh:
                    s.layers = self.begin(plan)
                sampled = self.run(s.layers, should_yield)  # type: ignore[arg-type]
        except BaseException:
            self._suspended = self.running_rank = None  # the driver resets the core after a failed step
            raise
        now = self.clock()
        with self.guard:
            return self.settle(s, sampled, now - t0, now)

    def take(self, should_yield: Callable[[], bool] | None) -> tuple[PlanPart, bool, Callable[[], bool] | None] | None:
        """The plan part the next step computes (the caller holds ``guard``): a lower rank's waiting
        prompts, whole, while a plan is suspended; else the suspended plan's remaining layers; else a
        fresh plan. With whether it is fresh (``begin`` it) and the ``should_yield`` it runs under
        (None: it runs whole). None: nothing to compute. A driver that computes the part over time
        (the simulator) calls this and ``settle`` itself."""
        core = self.core
        s = self._suspended
        if s is not None and s.launched not in core.in_flight:
            s = self._suspended = self.running_rank = None  # the core was reset (a failed step): the plan is gone
        if s is not None:
            if self.within_instance and core.scheduler.waits_before(s.rank):
                core.plan_around(s.launched)
                urgent = core.launch(self.send_finished, preempting=True)
                if urgent is not None:
                    self.num_preemptions += bool(urgent.plan.chunks)
                    s = PlanPart(urgent, None, 0)
                    self.last_num_batched_tokens = urgent.plan.num_batched_tokens
                    return s, True, None  # runs whole
            self.last_num_batched_tokens = s.launched.plan.num_batched_tokens
            return s, False, should_yield
        launched = core.launch(self.send_finished)
        if launched is None:
            self.last_num_batched_tokens = 0
            return None
        rank = plan_rank(core, launched.plan)
        s = self._suspended = PlanPart(launched, None, rank)
        self.running_rank = rank
        self.last_num_batched_tokens = launched.plan.num_batched_tokens
        if rank == 0 and self.within_instance:
            should_yield = None  # nothing ranks lower
        return s, True, should_yield

    def settle(self, s: PlanPart, sampled: list[SampledToken] | None, seconds: float, now: float) -> list[Sequence]:
        """The part ``take`` gave computed for ``seconds`` until ``now`` (the caller holds ``guard``):
        ``sampled`` None — it yielded, suspended; else its plan is applied. Returns the sequences
        that received a token."""
        s.seconds += seconds
        if sampled is None:
            self.num_yields += 1
            return []
        if s is self._suspended:
            self._suspended = self.running_rank = None
        core = self.core
        core.observe(s.launched.plan, s.seconds)
        updated = core.apply(s.launched, sampled, now)
        core.step_ended(s.seconds, now)
        return updated

    def stats(self) -> dict[str, int]:
        return {"layer_yields_total": self.num_yields, "layer_preemptions_total": self.num_preemptions}


__all__ = ["PlanPart", "PreemptibleSteps", "plan_rank"]
