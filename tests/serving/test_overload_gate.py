"""``OverloadGate``: a refusal that holds for every request (``QueueFullError.shared``) shuts the HTTP process's
door for its retry time, at most ``MAX_HOLD_S``; other refusals do not; the flag crosses process boundaries."""

from __future__ import annotations

import pickle

import pytest

from distserve.errors import QueueFullError
from distserve.serving import overload_gate
from distserve.serving.overload_gate import OverloadGate


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_shared_refusal_shuts_the_gate_for_its_retry_time() -> None:
    clock = Clock()
    gate = OverloadGate(clock)
    gate.check()  # open
    gate.observe(QueueFullError("the admission queue holds 9 requests, its limit", None, 0.4, shared=True))
    clock.t += 0.3
    assert gate.shut_for_s == pytest.approx(0.1)
    with pytest.raises(QueueFullError, match=r"refusing requests for 0\.10 s more: the admission queue holds 9") as info:
        gate.check()
    assert info.value.shared and info.value.retry_after_s == pytest.approx(0.1)
    clock.t += 0.11
    assert gate.shut_for_s == 0.0
    gate.check()  # the next request goes through and finds the queue's state
    assert gate.num_refused == 1


def test_long_and_unknown_retry_times_are_bounded() -> None:
    clock = Clock()
    gate = OverloadGate(clock)
    gate.observe(QueueFullError("predicted wait of 70 s", None, 60.0, shared=True))
    clock.t += overload_gate.MAX_HOLD_S - 0.01
    with pytest.raises(QueueFullError):
        gate.check()
    clock.t += 0.02
    gate.check()
    gate.observe(QueueFullError("64 requests in flight (max 64)", shared=True))  # no retry time given
    clock.t += overload_gate.UNKNOWN_HOLD_S / 2
    with pytest.raises(QueueFullError):
        gate.check()
    clock.t += overload_gate.UNKNOWN_HOLD_S
    gate.check()


@pytest.mark.parametrize("exc", [
    QueueFullError("tenant 'a' has 2 requests queued, its limit", None, 5.0),  # one tenant's bound
    QueueFullError("tenant 'a' is over its 600 tokens per minute", None, 5.0),
    ValueError("not a refusal"),
])
def test_refusals_of_one_tenant_or_request_leave_the_gate_open(exc: BaseException) -> None:
    gate = OverloadGate(Clock())
    gate.observe(exc)
    gate.check()


def test_a_later_shorter_refusal_does_not_shorten_the_hold() -> None:
    clock = Clock()
    gate = OverloadGate(clock)
    gate.observe(QueueFullError("long", None, 0.8, shared=True))
    gate.observe(QueueFullError("short", None, 0.1, shared=True))
    clock.t += 0.5
    with pytest.raises(QueueFullError, match="long"):
        gate.check()


def test_shared_survives_pickling_as_across_ray() -> None:
    back = pickle.loads(pickle.dumps(QueueFullError("full", "prompt", 2.5, shared=True)))
    assert (str(back), back.param, back.retry_after_s, back.shared) == ("full", "prompt", 2.5, True)
    assert not pickle.loads(pickle.dumps(QueueFullError("full"))).shared


def _call(door: overload_gate.OverloadDoor, method: str, path: str) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request through ``door`` (plain ASGI): its status, headers and body."""
    import asyncio

    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{not json", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}
    asyncio.run(door(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_the_door_refuses_generation_posts_while_the_gate_is_shut_and_passes_everything_else() -> None:
    import json

    from starlette.responses import PlainTextResponse

    clock, routed, refused = Clock(), [], []
    gate = OverloadGate(clock)

    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        routed.append(scope["path"])
        await PlainTextResponse("routed")(scope, receive, send)

    door = overload_gate.OverloadDoor(app, gate, refused.append)
    assert _call(door, "POST", "/v1/completions")[0] == 200  # open: the route runs (and parses the body)
    gate.observe(QueueFullError("512 requests in flight (max 512)", None, None, shared=True))
    for path in sorted(overload_gate.GATED_PATHS):
        status, headers, body = _call(door, "POST", path)
        error = json.loads(body)["error"]
        assert status == 429 and error["code"] == "queue_full" and headers[b"retry-after"] == b"1"
        assert error["message"].startswith("the server is refusing requests for") and "512 requests in flight" in error["message"]
    assert len(refused) == len(overload_gate.GATED_PATHS) == gate.num_refused
    assert _call(door, "GET", "/v1/models")[0] == 200 and _call(door, "POST", "/v1/session")[0] == 200  # not generation
    assert routed == ["/v1/completions", "/v1/models", "/v1/session"]
    clock.t += overload_gate.UNKNOWN_HOLD_S
    assert _call(door, "POST", "/v1/chat/completions")[0] == 200  # open again
