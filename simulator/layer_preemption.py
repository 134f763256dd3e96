"""Layer preemption in the simulator: a prefill plan of a backlogged rank yields between layers.

The runtime's prefill instance of one worker (tp = pp = 1) runs its plans through
``distserve.engine.preemptible.PreemptibleSteps``: a plan whose prompts have an admission rank above
0 asks after each layer but the last whether a prompt of a lower rank arrived; if so it stops there,
suspended, the lower rank's waiting prompts run whole in a plan of their own, and the suspended plan
resumes where it stopped (nothing is computed twice). ``LayeredPrefill`` drives that very object
(``take`` picks the part — a preempting plan, the suspended plan's rest, or a fresh plan — and
``settle`` applies it or counts the yield), so the scheduling decisions are the runtime's; this
module only times the parts. A plan's layers each take ``1 / num_layers`` of the latency model's
time of the whole plan; a prompt of a lower rank dispatched while a part that may yield computes
moves the part's end to the first layer boundary after the arrival (unless that is the last layer's
end), as ``InstanceServer.add`` setting the yield flag does.

With ``SimConfig.concurrent_slowdown`` the part's work is shared compute (``SharedCompute``): the
boundary is counted in solo seconds of work, and moves with the node's speed as any step's end does.
``Simulation`` uses this for prefill instances with tp = pp = 1 and
``SchedulerConfig.layer_preemption`` (default on); off, their plans run whole as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from distserve.engine.preemptible import PlanPart, PreemptibleSteps
from distserve.engine.sequence import Sequence
from distserve.engine.step_plan import SampledToken, StepPlan

if TYPE_CHECKING:
    from simulator.sim_instance import SharedCompute, SimInstance

_EPS = 1e-9  # a boundary reached "at" an arrival within float error has been checked already


def _asked() -> bool:
    """The ``should_yield`` handed to ``take``: only whether ``take`` keeps it (the part may yield) matters."""
    return False


def _unused(*args: object) -> None:
    raise AssertionError("the simulator times parts itself; PreemptibleSteps.step is never called")


class LayeredPrefill:
    """One simulated prefill instance's plans, computed a layer at a time by ``PreemptibleSteps``."""

    def __init__(self, inst: SimInstance, num_layers: int) -> None:
        # (It does not keep ``inst``: its caller passes it, so that the two make no reference cycle.)
        self.num_layers = num_layers
        self.steps = PreemptibleSteps(inst.core, _unused, _unused, _unused, send_finished=False)  # type: ignore[arg-type]
        self.part: PlanPart | None = None  # the part computing now
        self.may_yield = False  # it runs with a should_yield (a fresh or resumed plan of rank > 0)
        self._layers_done: dict[int, int] = {}  # plan_seq → layers computed (suspended plans)
        self._plan_s: dict[int, float] = {}  # plan_seq → seconds of the whole plan
        self.start_layer = self.end_layer = 0  # the layers the part in flight computes: [start, end)
        self.started_at = 0.0

    @property
    def plan(self) -> StepPlan:
        assert self.part is not None
        return self.part.launched.plan

    def stats(self) -> dict[str, int]:
        return self.steps.stats()

    def launch(self, inst: SimInstance, now: float, shared: SharedCompute | None, on_plan: Callable[[str, StepPlan], None] | None) -> list[SimInstance]:
        """Start the next part if none computes; the instances whose step end is (re)set (their
        ``stage_free[0]`` and ``step_version``), for the driver to queue."""
        if self.part is not None:
            return []
        taken = self.steps.take(_asked)
        if taken is None:
            return []
        part, fresh, should_yield = taken
        plan = part.launched.plan
        key = part.launched.plan_seq
        if fresh:
            if on_plan is not None:
                on_plan(inst.instance_id, plan)
            self._plan_s[key] = inst.step_time(inst.batch_shape(plan))
            self._layers_done[key] = 0
        self.part, self.may_yield = part, should_yield is not None
        self.start_layer, self.end_layer = self._layers_done[key], self.num_layers
        self.started_at = now
        solo_s = self._seconds(key, self.start_layer, self.end_layer)
        inst.busy_s += solo_s
        if shared is not None:
            return shared.start(inst, plan, solo_s, now)
        return _set_end(inst, now + solo_s)

    def arrived(self, inst: SimInstance, seq: Sequence, now: float, shared: SharedCompute | None) -> list[SimInstance]:
        """A prompt was dispatched here: if it ranks below the running plan and the part computing may
        yield, the part ends at the next layer boundary (the instances whose step end moved)."""
        running = self.steps.running_rank
        if self.part is None or not self.may_yield or running is None or seq.admission_rank >= running:
            return []
        key = self.part.launched.plan_seq
        layer_s = self._plan_s[key] / self.num_layers
        done_s = shared.progress(inst, now) if shared is not None else now - self.started_at
        boundary = self.start_layer + (math.floor(done_s / layer_s + _EPS) + 1 if layer_s > 0 else 1)
        if boundary >= self.end_layer:
            return []  # it stops there anyway (or runs its last layer, which never yields)
        solo_s = self._seconds(key, self.start_layer, boundary)
        inst.busy_s -= self._seconds(key, self.start_layer, self.end_layer) - solo_s
        self.end_layer = boundary
        if shared is not None:
            return shared.shorten(inst, now, solo_s)
        return _set_end(inst, self.started_at + solo_s)

    def done(self, now: float, tokens: Mapping[str, SampledToken]) -> list[Sequence]:
        """The part in flight ended at ``now``: it yielded (suspended) or its plan is applied. The
        sequences that received a token."""
        part = self.part
        assert part is not None
        self.part = None
        key = part.launched.plan_seq
        seconds = self._seconds(key, self.start_layer, self.end_layer)
        if self.end_layer < self.num_layers:
            self._layers_done[key] = self.end_layer
            return self.steps.settle(part, None, seconds, now)
        del self._layers_done[key], self._plan_s[key]
        sampled = [tokens[c.seq_id] for c in part.launched.plan.chunks if c.sample]
        return self.steps.settle(part, sampled, seconds, now)

    def _seconds(self, key: int, start: int, end: int) -> float:
        """Seconds plan ``key`` takes for layers [start, end): the whole plan's time, exactly, for all."""
        plan_s = self._plan_s[key]
        return plan_s if end - start == self.num_layers else plan_s * (end - start) / self.num_layers


def _set_end(inst: SimInstance, end: float) -> list[SimInstance]:
    inst.stage_free[0] = end
    inst.step_version += 1
    return [inst]


def layered_prefill(inst: SimInstance, num_layers: int, enabled: bool) -> LayeredPrefill | None:
    """The layer-by-layer driver for ``inst`` where the runtime has one: a prefill instance of one
    worker with ``layer_preemption`` on (``enabled``: and its steps take time)."""
    if enabled and inst.kind == "prefill" and inst.tp == inst.pp == 1 and inst.core.config.layer_preemption:
        return LayeredPrefill(inst, num_layers)
    return None


__all__ = ["LayeredPrefill", "layered_prefill"]
