"""The Ray controller's TPOT backpressure reads a decode instance's time per token as the interval between its
steps (the step and the controller's round trip, ``StepResult.token_interval_s``), ``pp`` of them for a pipelined
instance: each step launches one micro-batch and ends when the oldest finishes, so a request advances once per
``pp`` steps (read as one step, a PP=2 decode instance ran at twice the TPOT the rule allowed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from distserve.cluster.admission import AdmissionQueue, EntryLoad
from distserve.cluster.backpressure import Backpressure
from distserve.cluster.classes import DEFAULT_TIER
from distserve.runtime.admission_driver import AdmissionDriver


def driver(*instances: SimpleNamespace) -> AdmissionDriver:
    d = AdmissionDriver.__new__(AdmissionDriver)  # the controller's admission half, on plain instance records
    d.admission = AdmissionQueue("fcfs", backpressure=Backpressure(max_waiting=None, tpot_slo_s=0.5))
    d.instances = list(instances)
    return d


def instance(phase: str, pp: int, step_s: float, running: int = 4, alive: bool = True) -> SimpleNamespace:
    return SimpleNamespace(alive=alive, phase=phase, spec=SimpleNamespace(pp=pp),
                           last_step=SimpleNamespace(num_running=running, step_seconds=step_s / 3, token_interval_s=step_s * pp))


def test_a_pipelined_decode_instance_reads_pp_steps_per_token() -> None:
    assert driver(instance("decode", 2, 0.3))._measured_tpot() == pytest.approx(0.6)  # over the 0.5 s rule
    assert driver(instance("decode", 1, 0.3))._measured_tpot() == pytest.approx(0.3)
    # The best busy decode instance; prefill, idle and dead instances do not count.
    d = driver(instance("decode", 2, 0.2), instance("decode", 1, 0.5), instance("prefill", 1, 0.01),
               instance("decode", 1, 0.05, running=0), instance("decode", 1, 0.01, alive=False))
    assert d._measured_tpot() == pytest.approx(0.4)
    # What the rule then decides for an entry instance with nothing waiting (the 0.5 s TPOT rule).
    rule = d.admission.backpressure
    assert not rule.accepts(EntryLoad(0, driver(instance("decode", 2, 0.3))._measured_tpot()), DEFAULT_TIER)
    assert rule.accepts(EntryLoad(0, d._measured_tpot()), DEFAULT_TIER)


def test_decode_limits_count_what_the_prefill_side_holds() -> None:
    """The decode room (KV tokens) and headroom (requests, from the decode instance's time per token) less what
    the prefill instances hold: their latest step's count plus the requests sent to them since."""
    decode = instance("decode", 1, 0.25, running=8)  # half the 0.5 s rule: room for 8 more
    decode.last_step.num_free_blocks = 100
    prefill = instance("prefill", 1, 0.01)
    prefill.last_step.held_prompt_tokens, prefill.last_step.num_held, prefill.last_step.num_added = 320, 3, 5
    prefill.unseen = [(5, 0, 16), (6, 0, 40), (7, 0, 24)]  # add 5 was in the step; 6 and 7 were not
    d = driver(decode, prefill)
    d.cache_config = SimpleNamespace(block_size=16)
    assert d._decode_limits() == (100 * 16 - 320 - 64, 8 - 3 - 2)
    decode.last_step.token_interval_s = 0.6  # over the rule: no headroom
    assert d._decode_limits()[1] == -5
    decode.last_step.num_running = 0  # idle: nothing measured, the KV room decides
    assert d._decode_limits()[1] is None
