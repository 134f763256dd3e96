"""``StreamedSoFar``: continuing a request's stream with a re-run of it from scratch.

When the controller actor dies, its requests die with it; the proxy (``RemoteController``) submits
each again to the redeployed controller. The client has already received part of the answer, so the
re-run's outputs up to that point are dropped and the first one beyond it is handed on with its
``new_*`` fields cut to what the client has not seen. A re-run is only a continuation if it produces
the same tokens (greedy or seeded sampling): one that diverges ends the request with a
``ServiceUnavailableError`` rather than streaming a different answer.
"""

from __future__ import annotations

from dataclasses import replace

from distserve.engine.outputs import RequestOutput
from distserve.errors import ServiceUnavailableError


class StreamedSoFar:
    """Per completion (``RequestOutput.index``), the tokens and text already streamed to the caller."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[list[int], str]] = {}

    def record(self, out: RequestOutput) -> None:
        self._seen[out.index] = (list(out.token_ids), out.text)

    def continue_with(self, out: RequestOutput) -> RequestOutput | None:
        """``out`` of a re-run as the caller should get it: None if it brings nothing new (already
        streamed), else ``out`` with only the unseen tokens and text as ``new_*``.

        Raises ``ServiceUnavailableError`` if the re-run produced other tokens than were streamed.
        """
        seen = self._seen.get(out.index)
        if seen is None:
            return out
        ids, text = seen
        n = min(len(ids), len(out.token_ids))
        if out.token_ids[:n] != ids[:n]:
            raise _diverged(out)
        if len(out.token_ids) < len(ids) or (len(out.token_ids) == len(ids) and out.finish_reason is None):
            if out.finish_reason is not None:
                raise _diverged(out)  # it ended before what was already streamed
            return None
        if not out.text.startswith(text):
            raise _diverged(out)
        if len(out.new_token_ids) == len(out.token_ids) - len(ids) and len(out.new_text) == len(out.text) - len(text):
            return out  # the first run's outputs (and a re-run's past what was streamed): already right
        return replace(out, new_token_ids=list(out.token_ids[len(ids):]), new_text=out.text[len(text):])


def _diverged(out: RequestOutput) -> ServiceUnavailableError:
    return ServiceUnavailableError(
        f"the controller restarted and the re-run of request {out.request_id!r} produced other tokens than were "
        "already streamed (sampling that is neither greedy nor seeded); it cannot be continued"
    )
