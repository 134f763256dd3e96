"""The two ways an application talks to one ``distserve serve``: as a dataflow program, or request by request.

* ``DataflowClient``: our frontend (``distserve.dataflow.frontend``). ``submit_dag`` submits a
  program's whole DAG in two rounds of concurrent requests, whatever its depth: first the calls
  that read no other call (the server starts them at once) together with the creation of the
  variables the other calls pass on; then every other call, its output bound to its created
  variable (so a consumer may reach the server before its producer). The program then reads only
  its final variables; the server runs the DAG. Submissions carry the app's objective (Parrot's
  ``output_criteria``), so a call starts as soon as it and its inputs' producers have arrived.
* ``RequestClient``: the request-centric baseline over the OpenAI completions API (httpx). The
  program awaits each call before issuing the calls that depend on it; independent calls go out
  concurrently, as a good client would.

Both send the same prompts: a ``SemanticFunction``'s template rendered with its inputs, cut at
its output placeholder (``render``), with the output's sampling (``max_tokens``, greedy,
``ignore_eos``: every output has its configured length). ``template_function`` builds such a
function from a template string, so apps can size their prompts and outputs at run time.

A simulated client↔server network delay (``delay_s``, a round-trip time) is added to EVERY HTTP
request of both clients: half before the request is sent, half after its response arrives.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from distserve.dataflow.frontend import Input, Output, SemanticFunction, Session, Variable
from distserve.dataflow.template import PLACEHOLDER

TIMEOUT_S = 600.0
T = TypeVar("T")
# The frontend is synchronous and a read blocks its thread until the value exists: enough threads
# that every user, job and call of an app can wait at once (asyncio's default pool has cores + 4).
_POOL = ThreadPoolExecutor(max_workers=128, thread_name_prefix="dataflow-client")


def template_function(name: str, template: str, output: str, max_tokens: int) -> SemanticFunction:
    """A semantic function whose inputs are ``template``'s placeholders other than ``output``, which
    is generated greedily, exactly ``max_tokens`` tokens long (EOS ignored)."""
    names = list(dict.fromkeys(PLACEHOLDER.findall(template)))
    if output not in names:
        raise ValueError(f"{name}: output {{{{{output}}}}} is not in the template")

    def fn(**_: Any) -> None:
        pass

    fn.__name__ = name
    fn.__doc__ = template
    fn.__annotations__ = {n: Output(max_tokens=max_tokens, temperature=0, ignore_eos=True) if n == output else Input for n in names}
    fn.__signature__ = inspect.Signature([inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names])  # type: ignore[attr-defined]
    return SemanticFunction(fn)


def render(fn: SemanticFunction, inputs: Mapping[str, str]) -> tuple[str, dict[str, Any]]:
    """The prompt a call of ``fn`` sends (its template up to its one output, inputs filled in) and that output's sampling."""
    (output, spec), = fn.outputs.items()
    head = fn.template.split("{{" + output + "}}", 1)[0]
    return PLACEHOLDER.sub(lambda m: inputs[m.group(1)], head), dict(spec.sampling)


class DelayedSession(Session):
    """A frontend session whose every HTTP request takes ``delay_s`` longer (half each way)."""

    def __init__(self, base_url: str, delay_s: float, model_type: str = "token_id") -> None:
        self.delay_s = delay_s
        super().__init__(base_url, timeout_s=TIMEOUT_S, model_type=model_type)

    def _call(self, method: str, path: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        time.sleep(self.delay_s / 2)
        try:
            return super()._call(method, path, payload)
        finally:
            time.sleep(self.delay_s / 2)


class DataflowClient:
    """Dataflow programs: sessions, calls submitted with the app's objective, final reads. Async
    wrappers over the (synchronous) frontend, so independent submissions and reads run concurrently."""

    def __init__(self, base_url: str, delay_s: float = 0.0, model_type: str = "token_id") -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.delay_s = delay_s
        self.model_type = model_type  # "text": the engine gets exactly the request-centric client's prompts

    async def session(self) -> DelayedSession:
        return await _in_thread(lambda: DelayedSession(self.base_url, self.delay_s, self.model_type))

    async def close(self, session: Session) -> None:
        await _in_thread(session.close)

    async def submit_dag(self, session: Session, perf: str, calls: Sequence[tuple[SemanticFunction, Mapping[str, str | OutputOf]]]) -> list[Variable]:
        """Submit ``calls`` (each a function and its inputs: strings, or ``OutputOf`` another call) in two
        rounds (see the module docstring); every call's output variable, in order."""
        read = {arg.index for _, inputs in calls for arg in inputs.values() if isinstance(arg, OutputOf)}
        sources = [i for i, (_, inputs) in enumerate(calls) if not any(isinstance(a, OutputOf) for a in inputs.values())]
        passed = sorted(read - set(sources))
        outputs: dict[int, Variable] = {}
        first = await asyncio.gather(*(self.call(session, calls[i][0], perf, **calls[i][1]) for i in sources),  # type: ignore[arg-type]
                                     *(_in_thread(lambda i=i: session.variable(f"{calls[i][0].name}{i}")) for i in passed))
        outputs.update(zip([*sources, *passed], first))

        def args(i: int) -> dict[str, str | Variable]:
            fn, inputs = calls[i]
            bound = {name: outputs[a.index] if isinstance(a, OutputOf) else a for name, a in inputs.items()}
            return {**bound, **({name: outputs[i] for name in fn.outputs} if i in outputs else {})}

        rest = [i for i in range(len(calls)) if i not in sources]
        outputs.update(zip(rest, await asyncio.gather(*(self.call(session, calls[i][0], perf, **args(i)) for i in rest))))
        return [outputs[i] for i in range(len(calls))]

    async def call(self, session: Session, fn: SemanticFunction, perf: str, **args: str | Variable) -> Variable:
        """Submit one call of ``fn`` (inputs as strings or variables; its output bound to a ``Variable`` if given one)."""
        out = await _in_thread(lambda: fn(session, perf=perf, **args))
        assert isinstance(out, Variable)
        return out

    async def get(self, var: Variable, perf: str) -> str:
        return await _in_thread(lambda: var.get(perf))


@dataclass(frozen=True)
class OutputOf:
    """An input of a ``submit_dag`` call: the output of call ``index`` of the same DAG."""

    index: int


async def _in_thread(fn: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(_POOL, fn)


class RequestClient:
    """The request-centric baseline: one ``/v1/completions`` request per call, awaited by its dependents."""

    def __init__(self, base_url: str, delay_s: float = 0.0) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.delay_s = delay_s
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=TIMEOUT_S, trust_env=False,
                                       limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self._model: str | None = None

    async def complete(self, fn: SemanticFunction, **inputs: str) -> str:
        """One call of ``fn``: its generated text."""
        prompt, sampling = render(fn, inputs)
        return await self.completion(prompt, **sampling)

    async def completion(self, prompt: str, **sampling: Any) -> str:
        """A plain completions request (what a chat front end would send): the generated text."""
        if self._model is None:
            models = (await self._http.get("/v1/models")).json()["data"]
            self._model = str(models[0]["id"])
        await asyncio.sleep(self.delay_s / 2)
        resp = await self._http.post("/v1/completions", json={"model": self._model, "prompt": prompt, **sampling})
        await asyncio.sleep(self.delay_s / 2)
        if resp.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {resp.status_code}: {resp.text[:500]}")
        return str(resp.json()["choices"][0]["text"])

    async def aclose(self) -> None:
        await self._http.aclose()
