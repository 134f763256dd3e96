"""The one interface the HTTP layer talks to, whatever runs the requests.

``EngineClient`` is async and streaming. Implementations: ``ThreadedEngineClient`` drives any
in-process ``EngineBase`` (the colocated ``LLMEngine`` or ``LocalDisaggEngine``) from a background
thread; the Ray runtime's controller client implements the same methods over actor calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence as Seq

from distserve.cluster.classes import RequestClass
from distserve.config import SamplingParams
from distserve.engine.outputs import RequestOutput
from distserve.engine.structured_output import GrammarCompiler
from distserve.engine.tokenizer import Tokenizer


class EngineClient(ABC):
    """Submit, stream and abort requests; read gauges for metrics."""

    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    # Compiles structured-output grammars in this process (the HTTP layer checks a request's spec with it,
    # off the engine's thread); None: the client serves no structured output.
    grammar_compiler: GrammarCompiler | None = None

    @abstractmethod
    def generate(
        self,
        prompt: str | Seq[int],
        sampling: SamplingParams,
        request_id: str,
        priority: int = 0,
        request_class: RequestClass | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream this request's outputs until one has ``finished``. ``request_class`` is its
        scheduling class (objective, task group, tenant and tier, ``distserve.cluster.classes``;
        None: default). ``timeout_s``: the longest it may wait in the admission queue; past it the
        request ends with an output whose ``error_kind`` is "timeout" (None: no limit).

        Bad input raises a ``DistServeError`` from the first ``__anext__``; a full queue raises
        ``QueueFullError``. Closing the iterator early (client gone) aborts the request.
        """

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV everywhere; unknown ids are ignored."""

    @abstractmethod
    async def stats(self) -> dict[str, object]:
        """Gauges for /metrics (queue lengths, KV usage, migration counters), per instance where known."""

    @abstractmethod
    async def shutdown(self) -> None: ...

    @property
    def is_dead(self) -> bool:
        """True once the client can never serve again (the server process should exit)."""
        return False

    async def check_health(self) -> None:
        """Raise ``ServiceUnavailableError`` naming the outage if requests cannot be served now."""
