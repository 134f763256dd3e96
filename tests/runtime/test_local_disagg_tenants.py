"""``LocalDisaggEngine`` behind the admission queue, on the tiny model: two tenants share fairly,
bounds refuse with 429's error, deadlines fail queued requests, aborts leave nothing behind."""

from __future__ import annotations

import pytest

from distserve.cluster.classes import RequestClass
from distserve.cluster.tenants import TenantSpec
from distserve.cluster.admission import AdmissionConfig
from distserve.config import CacheConfig, SamplingParams, SchedulerConfig
from distserve.engine.step_plan import StepPlan
from distserve.engine.weights import LoadedModel, load_model
from distserve.errors import InvalidConfigError, QueueFullError
from distserve.runtime.local_disagg import LocalDisaggEngine

SP = SamplingParams(max_tokens=100, min_tokens=100, temperature=0.0, ignore_eos=True)
HEAVY, LIGHT = RequestClass(tenant="heavy"), RequestClass(tenant="light")


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def engine(tiny: LoadedModel, policy: str, **kwargs: object) -> LocalDisaggEngine:
    # One prompt per prefill step: requests queue, and the admission order shows in the plans.
    # The default backpressure (tokens): held while the waiting prompts fill the next step (here its one sequence).
    return LocalDisaggEngine(tiny, cache_config=CacheConfig(num_blocks=1024, block_size=4), admission=AdmissionConfig(policy, **kwargs),  # type: ignore[arg-type]
                             prefill_scheduler_config=SchedulerConfig(max_num_seqs=1))


def prefill_order(e: LocalDisaggEngine) -> list[str]:
    """Requests in the order their prefills start, running everything to completion."""
    order: list[str] = []

    def on_plan(instance_id: str, plan: StepPlan) -> None:
        for c in plan.chunks:
            if instance_id.startswith("prefill") and c.seq_id not in order:
                order.append(c.seq_id)

    e.on_plan = on_plan
    while e.has_unfinished_requests():
        e.step()
    return order


def add(e: LocalDisaggEngine, tenant: RequestClass, n: int, prefix: str) -> list[str]:
    return [e.add_request(list(range(1, 101)), SP, request_id=f"{prefix}{i}", request_class=tenant) for i in range(n)]


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_a_light_tenant_does_not_wait_behind_a_heavy_one(tiny: LoadedModel, policy: str) -> None:
    e = engine(tiny, policy)
    heavy = add(e, HEAVY, 10, "h")
    light = add(e, LIGHT, 3, "l")
    order = prefill_order(e)
    assert sorted(order) == sorted(heavy + light)
    positions = [order.index(r) for r in light]
    if policy == "fcfs":
        assert positions == [10, 11, 12]  # behind the whole backlog
    else:
        # Deficit round robin, cost 200 tokens, quantum 512: heavy sends 2 (112 left), light 2, heavy 3
        # (624 of deficit), light its third; the prefill scheduler keeps that order. (Neither tenant is
        # sparse: both queued before anything was dispatched.)
        assert positions == [2, 3, 7]
    stats = e.admission.stats()
    assert stats["tenants"]["light"]["num_dispatched"] == 3 and stats["num_queued"] == 0
    assert all(inst.core.block_manager.usage == 0.0 for inst in e.prefill + e.decode)


def test_bounds_refuse_and_leave_nothing_behind(tiny: LoadedModel) -> None:
    e = engine(tiny, "fair", tenants=(TenantSpec("heavy", max_queued_requests=4),))
    add(e, HEAVY, 4, "h")
    with pytest.raises(QueueFullError, match="tenant 'heavy'") as info:
        e.add_request([1, 2, 3], SP, request_id="h-over", request_class=HEAVY)
    assert info.value.retry_after_s is not None and info.value.retry_after_s > 0
    assert "h-over" not in e._seqs and e.num_requests == 4
    add(e, LIGHT, 1, "l")  # another tenant still gets in
    e.abort_request("h0")  # queued: simply removed
    assert e.admission.counters["heavy"].num_queued == 3
    prefill_order(e)
    assert not e.has_unfinished_requests()
    assert e.admission.counters["heavy"].num_rejected_full == 1


def test_a_request_past_its_timeout_fails_while_queued(tiny: LoadedModel) -> None:
    e = engine(tiny, "fair")
    add(e, HEAVY, 4, "h")  # one fills the prefill queue (backpressure: a step takes one sequence), three wait in admission
    late = e.add_request([5, 6, 7], SP, request_id="late", request_class=LIGHT, timeout_s=1e-9)
    outs = [o for o in e.step() if o.request_id == late]
    assert len(outs) == 1 and outs[0].finish_reason == "error" and "timeout" in (outs[0].error or "")
    assert e.admission.counters["light"].num_expired == 1
    prefill_order(e)
    assert not e.has_unfinished_requests()
    with pytest.raises(InvalidConfigError, match="timeout"):
        e.add_request([1], SP, timeout_s=-1)
    with pytest.raises(InvalidConfigError, match="unknown admission policy"):
        engine(tiny, "lottery")


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_a_light_prompt_overtakes_the_chunks_of_a_long_one(tiny: LoadedModel, policy: str) -> None:
    """Chunked prefill, 16 tokens a step: the heavy tenant's 64-token prompt is under way when the
    light tenant's 8-token prompt arrives. Under ``fair`` the light prompt (a sparse tenant's: a lower
    admission rank) runs in the next step, alone — before the long prompt's remaining chunks and
    without them; under ``fcfs`` it waits for all of the heavy tenant's prompts."""
    e = LocalDisaggEngine(tiny, cache_config=CacheConfig(num_blocks=1024, block_size=4), admission=AdmissionConfig(policy),
                          prefill_scheduler_config=SchedulerConfig(enable_chunked_prefill=True, max_num_batched_tokens=16))
    plans: list[list[tuple[str, int]]] = []
    e.on_plan = lambda inst, plan: plans.append([(c.seq_id, len(c.token_ids)) for c in plan.chunks]) if inst.startswith("prefill") else None
    heavy = [e.add_request(list(range(1, 65)), SP, request_id=f"h{i}", request_class=HEAVY) for i in range(3)]
    e.step()
    assert plans == [[("h0", 16)]]  # backpressure: 64 tokens pending fill the next step; h1, h2 wait in admission
    e.add_request(list(range(100, 108)), SP, request_id="l0", request_class=LIGHT)
    first_token: dict[str, int] = {}
    while e.has_unfinished_requests():
        for out in e.step():
            first_token.setdefault(out.request_id, len(plans))
    if policy == "fair":
        assert plans[1] == [("l0", 8)]  # the next step, on its own
        assert first_token["l0"] < first_token["h0"]
    else:
        assert all(first_token["l0"] > first_token[h] for h in heavy)
