"""The admission queue (``distserve.cluster.admission``) and its policies (``cluster.fair_queue``):
shares by tokens, tiers, priorities, classes, backpressure, bounds, token rates and deadlines."""

from __future__ import annotations

from collections import Counter

import pytest

from distserve.cluster.admission import (
    NO_BACKPRESSURE, AdmissionConfig, AdmissionItem, AdmissionQueue, Backpressure, DrainRate, EntryLoad, expired_error, measured_tpot_s,
)
from distserve.cluster.backpressure import decode_headroom
from distserve.cluster.queue_rates import QUEUE_BOUND_RETRY_SHARE
from distserve.cluster.classes import RequestClass
from distserve.cluster.fair_queue import ADMISSION_POLICIES, BACKLOGGED, FRESH, LEVELS, SPARSE
from distserve.cluster.tenants import TenantSpec
from distserve.errors import InvalidConfigError, QueueFullError, RequestTimeoutError


class Feeder:
    """Pushes items with unique ids and increasing arrival times."""

    def __init__(self, queue: AdmissionQueue) -> None:
        self.queue, self.n = queue, 0

    def push(self, tenant: str = "anonymous", cost: int = 100, k: int = 1, *, objective: str = "default", tier: str = "default",
             priority: int = 0, timeout_s: float | None = None, now: float = 0.0) -> list[str]:
        ids = []
        for _ in range(k):
            rid = f"r{self.n}"
            item = AdmissionItem(rid, RequestClass(objective, tenant=tenant, tier=tier), cost, float(self.n), priority, timeout_s)
            self.queue.push(item, now)
            ids.append(rid)
            self.n += 1
        return ids


def drain(queue: AdmissionQueue, n: int | None = None, now: float = 1.0) -> list[AdmissionItem]:
    """Dispatch to one instance that always accepts; the first ``n`` items (all by default)."""
    out = queue.dispatch(now, ["i0"], lambda inst: EntryLoad(0), lambda item, ok: ok[0])
    return [item for item, _ in out][:n]


def token_shares(items: list[AdmissionItem]) -> dict[str, float]:
    tokens = Counter()
    for item in items:
        tokens[item.tenant] += item.cost
    total = sum(tokens.values())
    return {t: v / total for t, v in tokens.items()}


def test_fair_shares_tokens_equally_whatever_the_number_and_length_of_requests() -> None:
    q = AdmissionQueue("fair", backpressure=NO_BACKPRESSURE)
    f = Feeder(q)
    f.push("many-short", 40, 500)  # many short requests
    f.push("few-long", 2000, 10)  # few long ones
    f.push("medium", 300, 70)
    # While every tenant still has work queued, each has had a third of the tokens.
    shares = token_shares(drain(q, 400))
    for share in shares.values():
        assert share == pytest.approx(1 / 3, abs=0.05)
    fcfs = AdmissionQueue("fcfs", backpressure=NO_BACKPRESSURE)
    g = Feeder(fcfs)
    g.push("many-short", 40, 500)
    g.push("few-long", 2000, 10)
    assert set(token_shares(drain(fcfs, 60))) == {"many-short"}  # fcfs: the first comer's backlog goes first


def test_fair_shares_follow_the_weights() -> None:
    q = AdmissionQueue("fair", {"gold": TenantSpec("gold", weight=3.0)}, backpressure=NO_BACKPRESSURE)
    f = Feeder(q)
    f.push("gold", 100, 300)
    f.push("plain", 250, 120)
    shares = token_shares(drain(q, 100))
    assert shares["gold"] == pytest.approx(0.75, abs=0.05)


def test_a_request_much_longer_than_the_quantum_is_served_in_its_turn() -> None:
    q = AdmissionQueue("fair", backpressure=NO_BACKPRESSURE, quantum=16)
    f = Feeder(q)
    f.push("a", 100_000, 2)
    f.push("b", 100_000, 2)
    assert [i.tenant for i in drain(q)] == ["a", "b", "a", "b"]


def test_tiers_are_strict_across_tenants() -> None:
    q = AdmissionQueue("fair", {"vip": TenantSpec("vip", tier="interactive"), "bulk": TenantSpec("bulk", tier="batch")},
                       backpressure=NO_BACKPRESSURE)
    f = Feeder(q)
    f.push("bulk", 10, 5)
    f.push("someone", 10, 5)
    f.push("vip", 1000, 5)
    order = [i.tenant for i in drain(q)]
    assert order == ["vip"] * 5 + ["someone"] * 5 + ["bulk"] * 5


def test_a_request_may_demote_itself_to_batch_but_not_promote_its_tenant() -> None:
    q = AdmissionQueue("fair", {"t": TenantSpec("t", tier="default"), "vip": TenantSpec("vip", tier="interactive")})
    assert q.tier_of(RequestClass(tenant="t", tier="batch")) == "batch"
    assert q.tier_of(RequestClass(tenant="t", tier="interactive")) == "default"
    assert q.tier_of(RequestClass(tenant="vip")) == "interactive"  # the request's "default": its tenant's tier
    assert q.tier_of(RequestClass(tenant="vip", tier="batch")) == "batch"
    assert q.tier_of(RequestClass(tenant="unknown", tier="interactive")) == "interactive"


def test_within_a_tenant_latency_class_then_priority_then_arrival() -> None:
    q = AdmissionQueue("fair", backpressure=NO_BACKPRESSURE)
    f = Feeder(q)
    backlog = f.push("t", 100, 5, objective="throughput")
    low = f.push("t", 100, priority=5)
    high = f.push("t", 100, priority=-1)
    call = f.push("t", 100, objective="latency", priority=9)
    assert [i.request_id for i in drain(q)] == call + high + low + backlog


def test_priority_policy_orders_globally_and_fcfs_by_arrival() -> None:
    for policy, expect in (("priority", ["r2", "r1", "r0"]), ("fcfs", ["r0", "r1", "r2"])):
        q = AdmissionQueue(policy, backpressure=NO_BACKPRESSURE)
        f = Feeder(q)
        f.push("a", 10, priority=3)
        f.push("b", 10_000, priority=1)
        f.push("c", 10, objective="latency")
        assert [i.request_id for i in drain(q)] == expect, policy


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(InvalidConfigError, match="unknown admission policy 'wfq'.*fair") as info:
        AdmissionQueue("wfq")
    assert info.value.param == "admission_policy"
    assert set(ADMISSION_POLICIES) == {"fcfs", "fair", "priority"}


def test_backpressure_holds_requests_while_instances_have_a_queue() -> None:
    q = AdmissionQueue("fair")  # default: fewer than 3 waiting
    f = Feeder(q)
    f.push("t", 10, 10)
    waiting = {"p0": 1, "p1": 3}
    out = q.dispatch(0.0, ["p0", "p1"], lambda i: EntryLoad(waiting[i]), lambda item, ok: ok[0])
    assert [inst for _, inst in out] == ["p0", "p0"]  # p1 is at the threshold; p0 takes two
    assert len(q) == 8 and q.counters["t"].num_queued == 8
    # A latency request arriving now overtakes the held-back backlog.
    call = f.push("t", 10, objective="latency")
    out = q.dispatch(0.5, ["p0"], lambda i: EntryLoad(0), lambda item, ok: ok[0])
    assert out[0][0].request_id == call[0]


def test_batch_goes_only_to_an_instance_with_nothing_waiting() -> None:
    bp = Backpressure()
    assert bp.accepts(EntryLoad(2), "default") and not bp.accepts(EntryLoad(3), "default")
    assert bp.accepts(EntryLoad(0), "batch") and not bp.accepts(EntryLoad(1), "batch")
    q = AdmissionQueue("fair")
    f = Feeder(q)
    f.push("t", 10, 3, tier="batch")
    out = q.dispatch(0.0, ["busy", "idle"], lambda i: EntryLoad(1 if i == "busy" else 0), lambda item, ok: ok[0])
    assert [inst for _, inst in out] == ["idle"]  # then "idle" has one waiting: the rest stay queued
    assert len(q) == 2


def test_tpot_backpressure() -> None:
    bp = Backpressure(tpot_slo_s=0.15)
    assert not bp.accepts(EntryLoad(0, tpot_s=0.2), "interactive")
    assert bp.accepts(EntryLoad(0, tpot_s=0.1), "interactive") and bp.accepts(EntryLoad(0, None), "default")
    assert measured_tpot_s([(0, 0.9), (4, 0.2), (2, 0.1)]) == 0.1  # the best busy instance; idle ones do not count
    assert measured_tpot_s([(0, 0.9)]) is None
    with pytest.raises(InvalidConfigError):
        Backpressure(max_waiting=0)


def test_decode_room_is_shared_by_every_prefill_instance() -> None:
    """Under the TPOT rule, prompts go to prefill instances only while the decode instances' free KV holds
    them; each dispatch takes from the room every prefill instance reads."""
    bp = Backpressure(tpot_slo_s=1.0)
    assert bp.accepts(EntryLoad(0, decode_room_tokens=64), "default", prompt_tokens=64)
    assert not bp.accepts(EntryLoad(0, decode_room_tokens=63), "default", prompt_tokens=64)
    assert Backpressure().accepts(EntryLoad(0, decode_room_tokens=0), "default", prompt_tokens=64)  # the rule is the TPOT SLO's
    q = AdmissionQueue("fcfs", backpressure=bp)
    for i in range(6):
        q.push(AdmissionItem(f"r{i}", RequestClass(), 50, float(i), num_prompt_tokens=40), 0.0)
    out = q.dispatch(0.0, ["p0", "p1"], lambda inst: EntryLoad(0, None, decode_room_tokens=100), lambda item, ok: ok[-1])
    assert [(item.request_id, inst) for item, inst in out] == [("r0", "p1"), ("r1", "p1")]  # 100 - 2 x 40 < 40: p0 takes none
    assert len(q) == 4


def test_decode_headroom_admits_in_proportion_to_the_decode_instances_spare_time_per_token() -> None:
    """Under the TPOT rule a disaggregated deployment's prefill side holds at most the requests the decode
    instances' time per token leaves room for: none from an instance at or over the TPOT, ceil(running x
    (tpot / per_token - 1)) (at least one) from one under it; unbounded while one decodes nothing."""
    assert decode_headroom([(10, 0.5)], 1.0, 0) == 10  # half the TPOT: the batch may double
    assert decode_headroom([(10, 0.8)], 1.0, 0) == 3  # ceil(2.5)
    assert decode_headroom([(10, 0.8)], 1.0, 4) == -1  # the prefill side already holds more
    assert decode_headroom([(2, 0.99)], 1.0, 0) == 1  # at least one while under the TPOT
    assert decode_headroom([(10, 1.0)], 1.0, 0) == 0 and decode_headroom([(10, 1.7)], 1.0, 0) == 0
    assert decode_headroom([(10, 0.5), (4, 2.0)], 1.0, 3) == 7  # summed over decode instances
    assert decode_headroom([(10, 0.5), (0, 0.0)], 1.0, 3) is None  # an idle one: nothing measured
    bp = Backpressure(tpot_slo_s=1.0)
    assert bp.accepts(EntryLoad(0, 0.5, decode_headroom=1), "default") and not bp.accepts(EntryLoad(0, 0.5, decode_headroom=0), "default")
    assert Backpressure().accepts(EntryLoad(0, decode_headroom=0), "default")  # the rule is the TPOT SLO's
    q = AdmissionQueue("fcfs", backpressure=bp)
    for i in range(5):
        q.push(AdmissionItem(f"r{i}", RequestClass(), 50, float(i), num_prompt_tokens=40), 0.0)
    out = q.dispatch(0.0, ["p0", "p1"], lambda inst: EntryLoad(0, 0.5, decode_headroom=3), lambda item, ok: ok[0])
    assert [item.request_id for item, _ in out] == ["r0", "r1", "r2"]  # shared by both prefill instances
    assert len(q) == 2


def test_bounds_raise_queue_full_with_retry_after_from_the_drain_rate() -> None:
    q = AdmissionQueue("fair", {"small": TenantSpec("small", max_queued_requests=2)}, max_queued_requests=5, backpressure=NO_BACKPRESSURE)
    f = Feeder(q)
    f.push("small", 10, 2)
    with pytest.raises(QueueFullError, match="tenant 'small' has 2 requests queued") as info:
        f.push("small", 10)
    assert info.value.retry_after_s == 1.0  # nothing dispatched yet: the default
    assert not info.value.shared  # one tenant's bound: other tenants' requests are still taken
    f.push("other", 10, 3)
    with pytest.raises(QueueFullError, match="admission queue holds 5") as info:
        f.push("other", 10)
    assert info.value.shared  # the whole queue's bound: every request would be refused now
    # One request dispatched every 0.25 s: the measured rate (4/s) sets Retry-After.
    q2 = AdmissionQueue("fcfs", {"s": TenantSpec("s", max_queued_requests=1)}, backpressure=NO_BACKPRESSURE)
    g = Feeder(q2)
    for k in range(6):
        g.push("s", 10, now=0.25 * k)
        drain(q2, now=0.25 * k)
    g.push("s", 10, now=1.5)
    with pytest.raises(QueueFullError) as info:
        g.push("s", 10, now=1.5)
    assert info.value.retry_after_s == pytest.approx(0.25)
    counters = q2.counters["s"]
    assert (counters.num_admitted, counters.num_dispatched, counters.num_rejected_full, counters.num_queued) == (7, 6, 1, 1)
    assert q.counters["small"].num_rejected_full == 1 and q.counters["other"].num_rejected_full == 1


def test_max_queue_delay_refuses_what_would_wait_too_long_at_the_backlogged_rate() -> None:
    """A backlogged queue draining one request per 0.5 s with a 2 s bound takes a request with 4 ahead
    of it and refuses one with 5 ahead, with Retry-After = its predicted wait beyond the bound. Idle
    time does not read as a slow drain: a request that found the queue empty ends no gap."""
    q = AdmissionQueue("fcfs", max_queue_delay_s=2.0, backpressure=Backpressure(max_waiting=1, waiting_unit="requests"))
    f = Feeder(q)

    def step(now: float) -> int:  # an instance with nothing waiting takes one request
        return len(q.dispatch(now, ["i0"], lambda inst: EntryLoad(0), lambda item, ok: ok[0]))

    assert q.backlog.wait_s(10) is None
    f.push(k=8, now=0.0)  # nothing measured yet: admitted whatever the length
    assert [step(0.5 * k) for k in range(1, 8)] == [1] * 7
    assert q.backlog.wait_s(4) == pytest.approx(2.0) and len(q) == 1
    f.push(k=4, now=3.5)  # 1 to 4 ahead: predicted 0.5 to 2.0 s, within the bound
    with pytest.raises(QueueFullError, match="predicted wait of 2.50 s, over its limit of 2 s") as info:
        f.push(now=3.5)
    assert info.value.retry_after_s == pytest.approx(0.5) and info.value.shared
    assert q.counters["anonymous"].num_rejected_full == 1
    assert [step(3.5 + 0.5 * k) for k in range(1, 6)] == [1] * 5 and len(q) == 0
    f.push(now=64.0)  # after a minute idle
    assert step(65.0) == 1
    assert q.backlog.wait_s(4) == pytest.approx(2.0)  # the idle minute is not a gap
    # Whatever the estimate, no request waits longer than the bound: those that did are shed (HTTP 429).
    f.push(k=3, now=70.0)
    f.push(now=71.0)
    assert q.expire(71.9) == [] and q.next_deadline() == pytest.approx(72.0)
    shed = q.expire(72.0)
    assert [i.request_id for i in shed] == ["r13", "r14", "r15"] and len(q) == 1 and q.next_deadline() == pytest.approx(73.0)
    assert all(i.shed and i.expired_kind == "shed" for i in shed) and shed[0].wait_s == pytest.approx(2.0)
    err = expired_error(shed[0], 72.0)
    assert isinstance(err, QueueFullError) and "waited 2.000 s in the admission queue" in str(err) and err.retry_after_s == 1.0
    assert q.counters["anonymous"].num_rejected_full == 4 and q.counters["anonymous"].num_expired == 0
    with pytest.raises(InvalidConfigError, match="max_queue_delay_s"):
        AdmissionConfig(max_queue_delay_s=0)
    assert AdmissionConfig(max_queue_delay_s=1.5).queue().max_queue_delay_s == 1.5


def test_a_refusal_for_the_predicted_wait_says_retry_after_a_share_of_the_bound() -> None:
    """Under a long bound the predicted excess is tiny at the queue's edge (here 0.5 s against a 20 s
    bound): Retry-After is at least ``QUEUE_BOUND_RETRY_SHARE`` of the bound, so the HTTP process's door
    stays shut that long instead of reopening for every drained slot."""
    q = AdmissionQueue("fcfs", max_queue_delay_s=20.0, backpressure=Backpressure(max_waiting=1, waiting_unit="requests"))
    f = Feeder(q)
    f.push(k=8, now=0.0)
    for k in range(1, 8):
        q.dispatch(0.5 * k, ["i0"], lambda inst: EntryLoad(0), lambda item, ok: ok[0])
    f.push(k=40, now=3.5)  # up to 40 ahead: a predicted 20.0 s, within the bound
    with pytest.raises(QueueFullError, match="predicted wait of 20.50 s") as info:
        f.push(now=3.5)
    assert info.value.retry_after_s == pytest.approx(QUEUE_BOUND_RETRY_SHARE * 20.0) == pytest.approx(1.0)


def test_a_continuation_is_neither_refused_nor_shed_for_its_predicted_wait() -> None:
    """A dataflow call that reads another call's output (``RequestClass.continues``) continues work done
    already: the predicted-wait bound that refuses a fresh request queues it, ``expire`` does not shed it
    (nor does ``next_deadline`` wake the driver for it), and the hard bound on the queue's length holds."""
    q = AdmissionQueue("fcfs", max_queue_delay_s=2.0, backpressure=Backpressure(max_waiting=1, waiting_unit="requests"))
    f = Feeder(q)

    def step(now: float) -> list[str]:
        return [item.request_id for item, _ in q.dispatch(now, ["i0"], lambda inst: EntryLoad(0), lambda item, ok: ok[0])]

    f.push(k=8, now=0.0)
    assert [len(step(0.5 * k)) for k in range(1, 8)] == [1] * 7 and len(q) == 1  # backlogged: one per 0.5 s
    f.push(k=4, now=3.5)
    with pytest.raises(QueueFullError, match="predicted wait of 2.50 s"):
        f.push(now=3.5)
    q.push(AdmissionItem("c0", RequestClass(continues=True), 100, 3.5), 3.5)  # the same wait: queued
    assert len(q) == 6 and q.counters["anonymous"].num_rejected_full == 1
    shed = q.expire(5.5)  # everything fresh has waited the bound by now; the continuation stays
    assert [i.request_id for i in shed] == ["r7", "r8", "r9", "r10", "r11"] and all(i.shed for i in shed)
    assert len(q) == 1 and q.next_deadline() == float("inf")
    assert step(6.0) == ["c0"]
    small = AdmissionQueue("fcfs", max_queued_requests=1)
    small.push(AdmissionItem("c1", RequestClass(continues=True), 100, 0.0), 0.0)
    with pytest.raises(QueueFullError, match="holds 1 requests, its limit"):
        small.push(AdmissionItem("c2", RequestClass(continues=True), 100, 0.0), 0.0)


def test_the_backlogged_rate_is_right_when_an_instance_takes_a_batch_at_once() -> None:
    """Chaos overload (issue 20): an entry instance freeing room for 64 at once after each 8 s read,
    with a 64-dispatch window, as a drain of ~0 s per request, and the queue let ~500 in under a 13 s
    bound. Now: 64 per 8 s is 0.125 s each, whatever the lumps; no estimate before 2 s are measured
    (a cold server's first batch); requests waiting in the entry instances count as ahead."""
    q = AdmissionQueue("fcfs", max_queue_delay_s=10.0, backpressure=Backpressure(max_waiting=64, waiting_unit="requests"))
    f = Feeder(q)

    def batch(now: float) -> int:  # the instance has room for 64
        return len(q.dispatch(now, ["i0"], lambda inst: EntryLoad(0), lambda item, ok: ok[0]))

    f.push(k=300, now=0.0)
    assert batch(0.0) == 64  # found the queue empty: no gap
    assert batch(1.0) == 64 and q.backlog.wait_s(1) is None  # 1 s measured: too little to trust
    assert batch(9.0) == 64 and q.backlog.wait_s(80) == pytest.approx(80 * 9.0 / 128)
    assert batch(17.0) == 64 and q.backlog.wait_s(1) == pytest.approx(17.0 / 192)
    f.push(k=44, now=17.0)  # 44 + 44 queued: 88 x 17/192 = 7.8 s
    with pytest.raises(QueueFullError, match=r"\(40 more wait in the entry instances\), a predicted wait of 11\.33 s"):
        q.push(AdmissionItem("late", RequestClass("default"), 100, 17.0, 0, None), 17.0, waiting_ahead=40)
    assert batch(25.0) == 64 and q.backlog.wait_s(1) == pytest.approx(25.0 / 256)
    # Gaps older than the last 30 s of them leave the window: one at a time, 0.5 s apart, is the rate.
    f.push(k=60, now=25.0)  # 84 queued: predicted 8.2 s
    for k in range(1, 81):
        assert len(q.dispatch(25.0 + 0.5 * k, ["i0"], lambda inst: EntryLoad(63), lambda item, ok: ok[0])) == 1
    assert q.backlog.wait_s(1) == pytest.approx(0.5)


def test_calls_that_overtake_the_backlog_do_not_hide_it_from_the_drain_rate() -> None:
    """Chaos overload (issue 20): a dataflow program's latency-class calls, fresh, went before the chat
    backlog at every dispatch; the gap was recorded only when the dispatched request had itself waited
    through it, so no gap ever was, the predicted wait stayed unknown and nothing was refused at push
    (everything queued waited the bound and was shed). The queue was backlogged all along: it counts."""
    q = AdmissionQueue("fair", max_queue_delay_s=60.0, backpressure=Backpressure(max_waiting=1, waiting_unit="requests"))
    f = Feeder(q)
    f.push(k=20, now=0.0)
    assert len(q.dispatch(0.0, ["i0"], lambda inst: EntryLoad(0), lambda item, ok: ok[0])) == 1
    for k in range(1, 6):
        (latency,) = f.push(objective="latency", now=k - 0.5)
        ((item, _),) = q.dispatch(float(k), ["i0"], lambda inst: EntryLoad(0), lambda item, ok: ok[0])
        assert item.request_id == latency
    assert q.backlog.wait_s(1) == pytest.approx(1.0)


def test_a_stalled_queue_drains_slowly() -> None:
    rate = DrainRate()
    for t in (0.0, 0.1, 0.2):
        rate.record(t)
    assert rate.per_s(0.2) == pytest.approx(10.0)
    assert rate.per_s(5.2) == pytest.approx(0.2)  # nothing for 5 s: at most one per 5 s


def test_token_bucket_limits_tokens_per_minute() -> None:
    q = AdmissionQueue("fair", {"t": TenantSpec("t", tokens_per_minute=600)}, backpressure=NO_BACKPRESSURE)
    f = Feeder(q)
    f.push("t", 400, now=0.0)
    f.push("t", 200, now=0.0)
    with pytest.raises(QueueFullError, match="600 tokens per minute") as info:
        f.push("t", 100, now=0.0)
    assert info.value.retry_after_s == pytest.approx(10.0) and not info.value.shared  # 100 tokens at 10 tokens/s
    f.push("t", 100, now=10.0)
    f.push("t", 5000, now=70.0)  # larger than the bucket: admitted when it is full, leaving a debt
    with pytest.raises(QueueFullError):
        f.push("t", 1, now=100.0)
    assert q.counters["t"].num_rejected_rate == 2
    f.push("other", 10_000)  # other tenants are not limited


def test_deadlines_expire_items_and_count_them() -> None:
    q = AdmissionQueue("fair", backpressure=NO_BACKPRESSURE)
    f = Feeder(q)
    short = f.push("t", 10, timeout_s=1.0, now=0.0)
    f.push("t", 10, now=0.0)
    f.push("u", 10, timeout_s=5.0, now=0.5)
    assert q.expire(0.9) == []
    expired = q.expire(1.2)
    assert [i.request_id for i in expired] == short and expired[0].wait_s == pytest.approx(1.2)
    assert len(q) == 2 and q.counters["t"].num_expired == 1 and q.counters["t"].num_queued == 1
    err = expired_error(expired[0], 1.2)
    assert isinstance(err, RequestTimeoutError) and err.param == "timeout" and "waited 1.200 s" in str(err)
    with pytest.raises(InvalidConfigError, match="timeout"):
        f.push("t", 10, timeout_s=-1.0)


def test_remove_and_wait_times() -> None:
    q = AdmissionQueue("fair", backpressure=NO_BACKPRESSURE)
    f = Feeder(q)
    a, b = f.push("t", 10, 2, now=1.0)
    assert q.remove(a) is not None and q.remove(a) is None
    (item,) = drain(q, now=3.5)
    assert item.request_id == b and item.wait_s == pytest.approx(2.5)
    assert q.counters["t"].wait_s_total == pytest.approx(2.5)
    assert q.stats()["tenants"]["t"]["num_dispatched"] == 1


# ---- token backpressure and admission ranks ---------------------------------------------------
def test_token_backpressure_counts_the_prompt_tokens_waiting_ahead_of_the_request() -> None:
    bp = Backpressure()  # the default: tokens
    assert bp.waiting_unit == "tokens"
    # 3000 tokens of rank 3 (backlogged) waiting, none of rank 2: a step computes 2048.
    load = EntryLoad(1, None, (0, 0, 0, 3000), step_tokens=2048, step_seqs=64)
    assert bp.accepts(load, "default", rank=2)  # a sparse tenant's request goes before them
    assert not bp.accepts(load, "default", rank=3)  # a backlogged one would wait more than a step
    assert bp.accepts(EntryLoad(1, None, (0, 0, 0, 2047), 2048, 64), "default", rank=3)
    assert not bp.accepts(EntryLoad(4, None, (0, 0, 0, 10), 2048, 4), "default", rank=3)  # a step takes 4 sequences
    assert not bp.accepts(EntryLoad(1, None, (), 2048, 64), "batch")  # batch: only where nothing waits (TNG)
    assert bp.accepts(EntryLoad(2), "default") and not bp.accepts(EntryLoad(3), "default")  # no token figures: the count rule
    # TNG's count rule, kept: the tokens do not matter.
    tng = Backpressure(waiting_unit="requests")
    assert tng.accepts(EntryLoad(2, None, (0, 0, 0, 10**6), 2048, 64), "default", rank=3)
    assert not tng.accepts(EntryLoad(3, None, (), 2048, 64), "default", rank=0)
    with pytest.raises(InvalidConfigError) as info:
        Backpressure(waiting_unit="bytes")
    assert info.value.param == "waiting_unit"
    with pytest.raises(InvalidConfigError, match="waiting_unit"):
        AdmissionConfig(waiting_unit="seconds")


def test_dispatch_fills_one_step_with_prompt_tokens() -> None:
    q = AdmissionQueue("fcfs")
    for i in range(6):
        q.push(AdmissionItem(f"r{i}", RequestClass(), 50, float(i), num_prompt_tokens=40), 0.0)
    load = EntryLoad(0, None, (), step_tokens=100, step_seqs=64)
    out = q.dispatch(0.0, ["p0"], lambda inst: load, lambda item, ok: ok[0])
    assert [item.request_id for item, _ in out] == ["r0", "r1", "r2"]  # 0, 40, 80 tokens ahead: the third fills the step
    assert load.with_dispatched(out[0][0]).pending_tokens == (40,) and all(item.rank == 0 for item, _ in out)  # fcfs: one rank


def test_a_pipelined_prefill_instance_keeps_a_step_per_micro_batch_waiting() -> None:
    """``step_capacity``: what the token rule keeps waiting at an entry instance, per micro-batch of a
    pipelined prefill instance (it launches one whenever stage 0 is free), from every driver's load alike."""
    from distserve.cluster.backpressure import entry_load, step_capacity
    from distserve.config import SchedulerConfig
    from distserve.engine.block_manager import BlockManager
    from distserve.prefill.scheduler import PrefillScheduler

    config = SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8)
    assert step_capacity(config, "prefill") == (100, 8) and step_capacity(config, "prefill", 3) == (300, 24)
    assert step_capacity(config, "colocated", 3) == (100, 8)  # its micro-batches carry its decodes: one step's worth
    for pp, dispatched in ((1, 3), (2, 5)):  # tokens ahead 0, 40, 80 (< 100); with pp = 2 up to 160 (< 200)
        sched = PrefillScheduler(config, BlockManager(64, 16), 2048, pipeline_depth=pp)
        load = entry_load(sched, None)
        assert (load.step_tokens, load.step_seqs) == (100 * pp, 8 * pp)
        q = AdmissionQueue("fcfs")
        for i in range(8):
            q.push(AdmissionItem(f"r{i}", RequestClass(), 50, float(i), num_prompt_tokens=40), 0.0)
        assert len(q.dispatch(0.0, ["p0"], lambda inst: load, lambda item, ok: ok[0])) == dispatched


def test_fair_ranks_sparse_tenants_first_here_and_in_the_scheduler() -> None:
    default = LEVELS * 1  # the default tier's first rank
    q = AdmissionQueue("fair", backpressure=NO_BACKPRESSURE)
    f = Feeder(q)
    heavy = f.push("heavy", 2000, 6)
    first = drain(q, now=0.0)
    # Alone, a tenant is never sparse (no one to go before): the backlogged level.
    assert [i.request_id for i in first] == heavy and {i.rank for i in first} == {default + BACKLOGGED}
    heavy = f.push("heavy", 2000, 4)
    light = f.push("light", 300)
    out = drain(q)
    assert out[0].request_id == light[0] and out[0].rank == default + FRESH  # a sparse tenant: ahead of the backlog
    assert [i.request_id for i in out[1:]] == heavy and {i.rank for i in out[1:]} == {default + BACKLOGGED}
    # A tenant sending more than its share is no longer sparse, whatever it does between requests.
    ranks = []
    for _ in range(6):
        f.push("light", 2000)
        ranks.extend(i.rank for i in drain(q))
    assert ranks[0] == default + SPARSE and ranks[-1] == default + BACKLOGGED  # SPARSE: longer than a quantum
    # The tier comes first: an interactive request (ranks 0-2; alone in its tier: backlogged) outranks any default one.
    f.push("other", 100, tier="interactive")
    assert drain(q)[0].rank == BACKLOGGED
    # fcfs ranks everything alike; priority by tier, as LEVELS × tier (the tier is rank // LEVELS under every policy).
    for policy, ranks in (("fcfs", [0, 0]), ("priority", [3, 6])):  # type: ignore[assignment]
        p = AdmissionQueue(policy, backpressure=NO_BACKPRESSURE)
        g = Feeder(p)
        g.push("a", 10, tier="batch")
        g.push("b", 10)
        assert sorted(i.rank for i in drain(p)) == ranks


def test_a_tenant_that_starts_flooding_is_fresh_for_one_request_only() -> None:
    """FQ-CoDel's new flows: a newcomer is FRESH for its first request; the ones it sends within the
    next second or so are SPARSE (then backlogged, past its share), so a chat tenant's next request
    goes before them here and in the scheduler — FRESH, although the chat tenants had more than
    their share before the flood began."""
    default = LEVELS * 1
    q = AdmissionQueue("fair", backpressure=NO_BACKPRESSURE)
    f = Feeder(q)
    t = 0.0
    for _ in range(8):  # history: three chat tenants, a request every 3 s each, nothing from "flood"
        for tenant in ("a", "b", "c"):
            t += 1.0
            f.push(tenant, 96, now=t)
            drain(q, now=t)
    flood = []
    for _ in range(3):  # the flood starts: a request every 0.1 s
        t += 0.1
        f.push("flood", 474, now=t)
        flood += drain(q, now=t)
    assert [i.rank for i in flood][:2] == [default + FRESH, default + SPARSE] and flood[2].rank > default + FRESH  # then its share runs out
    f.push("a", 96, now=t + 0.1)
    assert drain(q, now=t + 0.1)[0].rank == default + FRESH
    # A burst is over a few seconds on: the flood's next request is FRESH again unless its share ran out.
    t += 5.0
    f.push("flood", 474, now=t)
    assert drain(q, now=t)[0].rank in (default + FRESH, default + BACKLOGGED)
    # A tenant under its share sending a burst of requests at once: FRESH while its tokens are under
    # half a quantum (three of 96), then SPARSE.
    q = AdmissionQueue("fair", backpressure=NO_BACKPRESSURE)
    f = Feeder(q)
    f.push("big", 2000, 2)
    drain(q)
    f.push("chat", 96, 7, now=1.0)
    assert [i.rank for i in drain(q, now=1.0)] == [default + FRESH] * 3 + [default + SPARSE] * 4
    # A burst decays with time: the same tenant, quiet for a second, is FRESH again.
    f.push("chat", 96, now=3.0)
    assert drain(q, now=3.0)[0].rank == default + FRESH


def test_a_task_group_stays_together_in_the_admission_queue() -> None:
    q = AdmissionQueue("fair", backpressure=NO_BACKPRESSURE)
    group = RequestClass("throughput", "g", tenant="t")
    for i, cls in enumerate([group, RequestClass("throughput", tenant="t"), group]):
        q.push(AdmissionItem(f"r{i}", cls, 10, float(i)), 0.0)
    assert [i.request_id for i in drain(q)] == ["r0", "r2", "r1"]  # the late member joins its group's first
