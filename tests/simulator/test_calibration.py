"""``StepTrace`` records the steps a controller reports to its step listeners, and stops when closed."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from distserve.runtime.instance_protocol import StepResult
from simulator.calibration import StepTrace


class FakeController:
    """The listener half of ``Controller``: ``add_step_listener`` and a way to report a step."""

    def __init__(self) -> None:
        self.listeners: list[Callable[[Any], None]] = []

    def add_step_listener(self, listener: Callable[[Any], None]) -> Callable[[], None]:
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener)

    def step(self, instance_id: str, t: float, prefill: tuple[int, ...] = (), decode: tuple[int, ...] = (),
             num_tokens: int | None = None, has_work: bool = True) -> None:
        result = StepResult(has_work=has_work, step_seconds=0.01, execute_seconds=0.008,
                            num_batched_tokens=sum(prefill) + len(decode) if num_tokens is None else num_tokens)
        event = SimpleNamespace(instance_id=instance_id, phase=instance_id.split("-")[0], result=result, time=t,
                                prefill_lens=prefill, decode_ctx=decode)
        for listener in list(self.listeners):
            listener(event)


def test_records_attributable_steps_with_cycles_and_shapes() -> None:
    controller = FakeController()
    with StepTrace(controller) as trace:  # type: ignore[arg-type]
        controller.step("prefill-0", 0.0, prefill=(5,))  # not enabled: not recorded, but its shape is seen
        trace.enabled = True
        controller.step("prefill-0", 1.0, prefill=(5,))
        controller.step("prefill-0", 1.5, prefill=(3,), num_tokens=4)  # a token count the updates do not explain
        controller.step("decode-0", 2.0, decode=(9, 12), has_work=False)
        controller.step("decode-0", 2.5, decode=(10, 13))  # the previous step had no more work: no cycle
        controller.step("decode-0", 2.6, decode=(11, 14))
        trace.new_run()
        controller.step("decode-0", 3.0, decode=(12, 15))  # a new run: no cycle across the gap
        controller.step("decode-0", 3.2, decode=(), num_tokens=0)  # an idle step: nothing to record
    assert not controller.listeners
    steps = trace.steps
    assert [(s["phase"], s["prefill_lens"], s["decode_ctx"]) for s in steps] == [
        ("prefill", [5], []), ("decode", [], [9, 12]), ("decode", [], [10, 13]), ("decode", [], [11, 14]),
        ("decode", [], [12, 15]),
    ]
    assert [s["new_shape"] for s in steps] == [False, True, False, False, False]
    assert [None if s["cycle_s"] is None else round(s["cycle_s"], 6) for s in steps] == [None, None, None, 0.1, None]
    assert all(s["step_s"] == 0.01 and s["execute_s"] == 0.008 for s in steps)
    controller.step("decode-0", 4.0, decode=(13, 16))  # closed: no longer listening
    assert len(trace.steps) == 5
