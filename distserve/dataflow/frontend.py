"""Our Python client of the semantic-variable API: ``@semantic_function``, variables, sessions.

    from distserve.dataflow.frontend import Input, Output, Session, semantic_function

    @semantic_function
    def summarize(doc: Input, summary: Output(max_tokens=64, temperature=0)):
        \"\"\"Document: {{doc}}
        Summary: {{summary}}\"\"\"

    @semantic_function
    def title(text: Input(transforms=[{"op": "strip"}]), title: Output(max_tokens=16)):
        \"\"\"Summary: {{text}}
        A five-word title: {{title}}\"\"\"

    with Session("http://127.0.0.1:8000") as s:
        t = title(s, text=summarize(s, doc="Bees make honey..."))   # two calls, no round trip between them
        print(t.get(perf="latency"))                                 # the server runs the DAG

A semantic function's docstring is its template; its parameters annotated ``Input`` are inputs (a
string, or a ``Variable`` produced by another call) and those annotated ``Output`` are generated.
Calling it submits the call and returns its output ``Variable`` (or a tuple of them, in parameter
order) at once. An output argument given a ``Variable`` (``fn(s, text=..., summary=var)`` with
``var = s.variable()``) is generated into it: a program that creates its variables first can
submit a consumer before its producer, so all of a DAG's calls go out concurrently, in one round. ``Variable.get(perf=...)`` states the objective (``latency`` or ``throughput``)
and waits for the value; ``aget`` is the async form. ``Variable.stream(perf=...)`` (``astream``)
yields the text as the server generates it (``GET /v1/semantic_var/{id}/stream``): the output's
raw generation, whose pieces join into exactly the value ``get`` returns. Errors come back as
``DataflowClientError`` with the server's status and message (also when a stream ends in one).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

DEFAULT_TIMEOUT_S = 600.0


class DataflowClientError(RuntimeError):
    """The server refused a request or a read failed; ``status`` and ``param`` are the server's."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.param = param


@dataclass(frozen=True)
class Input:
    """An input parameter; ``transforms`` apply to a variable's value when the call reads it."""

    transforms: tuple[Mapping[str, Any], ...] | list[Mapping[str, Any]] = ()


@dataclass(frozen=True)
class Output:
    """An output parameter and its sampling (our field names or Parrot's ``SamplingConfig`` ones)."""

    sampling: Mapping[str, Any] = field(default_factory=dict)

    def __init__(self, **sampling: Any) -> None:
        object.__setattr__(self, "sampling", dict(sampling))


class Session:
    """One server-side session; a context manager that deletes it on exit.

    ``model_type`` (Parrot's field, sent with every call): ``token_id`` builds each prompt from
    token ids at placeholder boundaries (generated variables as the ids they were generated as);
    ``text`` sends the rendered string, exactly what a request-at-a-time client would send.
    """

    def __init__(self, base_url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, model_type: str = "token_id") -> None:
        self.base_url = base_url.rstrip("/")
        self.model_type = model_type
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)
        created = self._post("/v1/session", {})
        self.session_id: int = created["session_id"]
        self.session_auth: str = created["session_auth"]

    @property
    def auth(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "session_auth": self.session_auth}

    def variable(self, name: str = "var", value: str | None = None) -> Variable:
        """A new client-set variable (set now if ``value`` is given)."""
        var = Variable(self, self._post("/v1/semantic_var", {**self.auth, "var_name": name})["var_id"], name)
        if value is not None:
            var.set(value)
        return var

    def submit(self, template: str, placeholders: list[dict[str, Any]], output_criteria: str | None = None) -> dict[str, Any]:
        payload = {**self.auth, "template": template, "placeholders": placeholders, "model_type": self.model_type}
        if output_criteria is not None:
            payload["output_criteria"] = output_criteria
        return self._post("/v1/semantic_call", payload)

    def close(self) -> None:
        try:
            self._call("DELETE", f"/v1/session/{self.session_id}", self.auth)
        finally:
            self._http.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, path: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        return self._call("POST", path, payload)

    def _call(self, method: str, path: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        return _checked(self._http.request(method, path, json=dict(payload)))


@dataclass(frozen=True)
class Variable:
    """A semantic variable of a session: set it (client-set ones), or read it with an objective."""

    session: Session
    var_id: str
    name: str

    def set(self, value: str) -> None:
        self.session._post(f"/v1/semantic_var/{self.var_id}", {**self.session.auth, "content": value})

    def get(self, perf: str = "latency", timeout_s: float | None = None) -> str:
        return str(self.session._call("GET", f"/v1/semantic_var/{self.var_id}", self._read(perf, timeout_s))["content"])

    async def aget(self, perf: str = "latency", timeout_s: float | None = None) -> str:
        async with httpx.AsyncClient(base_url=self.session.base_url, timeout=self.session._http.timeout) as http:
            return str(_checked(await http.request("GET", f"/v1/semantic_var/{self.var_id}", json=self._read(perf, timeout_s)))["content"])

    def stream(self, perf: str = "latency", timeout_s: float | None = None) -> Iterator[str]:
        """The variable's text as it is generated, in pieces; they join into its value."""
        with self.session._http.stream("GET", f"/v1/semantic_var/{self.var_id}/stream", json=self._read(perf, timeout_s)) as response:
            if response.status_code >= 400:
                response.read()
                _checked(response)
            yield from _deltas(response.iter_lines())

    async def astream(self, perf: str = "latency", timeout_s: float | None = None) -> AsyncIterator[str]:
        async with httpx.AsyncClient(base_url=self.session.base_url, timeout=self.session._http.timeout) as http:
            async with http.stream("GET", f"/v1/semantic_var/{self.var_id}/stream", json=self._read(perf, timeout_s)) as response:
                if response.status_code >= 400:
                    await response.aread()
                    _checked(response)
                async for line in response.aiter_lines():
                    for delta in _deltas((line,)):
                        yield delta

    def _read(self, perf: str, timeout_s: float | None) -> dict[str, Any]:
        return {**self.session.auth, "criteria": perf, **({"timeout": timeout_s} if timeout_s is not None else {})}


class SemanticFunction:
    """A docstring template with ``Input``/``Output`` parameters; call it with a ``Session`` first."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        doc = inspect.getdoc(fn)
        if not doc:
            raise TypeError(f"semantic function {fn.__name__} needs its template as its docstring")
        self.name = fn.__name__
        self.template = doc  # ``getdoc`` dedents it
        self.inputs: dict[str, Input] = {}
        self.outputs: dict[str, Output] = {}
        annotations = inspect.get_annotations(fn, eval_str=True)  # also under ``from __future__ import annotations``
        for name in inspect.signature(fn).parameters:
            kind = annotations.get(name)
            if kind is Input or isinstance(kind, Input):
                self.inputs[name] = kind if isinstance(kind, Input) else Input()
            elif kind is Output or isinstance(kind, Output):
                self.outputs[name] = kind if isinstance(kind, Output) else Output()
            else:
                raise TypeError(f"parameter {name!r} of {fn.__name__} must be annotated Input or Output")

    def __call__(self, session: Session, *, perf: str | None = None, **args: str | Variable) -> Variable | tuple[Variable, ...]:
        """Submit one call: every input as a string or ``Variable``; an output given a ``Variable`` is generated into it."""
        inputs = {name: value for name, value in args.items() if name not in self.outputs}
        bound = {name: value for name, value in args.items() if name in self.outputs}
        missing = sorted(set(self.inputs) - set(inputs))
        extra = sorted(set(inputs) - set(self.inputs))
        if missing or extra:
            raise TypeError(f"{self.name}() needs inputs {sorted(self.inputs)}; missing {missing}, unexpected {extra}")
        not_vars = sorted(name for name, value in bound.items() if not isinstance(value, Variable))
        if not_vars:
            raise TypeError(f"{self.name}(): outputs {not_vars} can only be given a Variable to generate into")
        placeholders: list[dict[str, Any]] = []
        for name, spec in self.inputs.items():
            value = inputs[name]
            ph: dict[str, Any] = {"name": name, "is_output": False}
            if isinstance(value, Variable):
                ph["var_id"] = value.var_id
            else:
                ph["value"] = str(value)
            if spec.transforms:
                ph["transforms"] = [dict(t) for t in spec.transforms]
            placeholders.append(ph)
        for name, spec in self.outputs.items():
            out: dict[str, Any] = {"name": name, "is_output": True, "sampling_config": dict(spec.sampling)}
            if name in bound:
                out["var_id"] = bound[name].var_id  # type: ignore[union-attr]
            placeholders.append(out)
        info = session.submit(self.template, placeholders, perf)["param_info"]
        by_name = {p["placeholder_name"]: p["var_id"] for p in info}
        outs = tuple(v if isinstance(v := bound.get(name), Variable) else Variable(session, by_name[name], name) for name in self.outputs)
        return outs[0] if len(outs) == 1 else outs


def semantic_function(fn: Callable[..., Any]) -> SemanticFunction:
    """Turn a function whose docstring is a template into a ``SemanticFunction``."""
    return SemanticFunction(fn)


def _deltas(lines: Iterable[str]) -> Iterator[str]:
    """The text deltas of SSE ``lines``; an error event raises ``DataflowClientError``."""
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        if "error" in event:
            error = event["error"]
            raise DataflowClientError(int(event.get("status", 500)), error.get("message", ""), error.get("param"))
        if event.get("delta"):
            yield event["delta"]


def _checked(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = {}
    if response.status_code >= 400:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        raise DataflowClientError(response.status_code, error.get("message", response.text), error.get("param"))
    return body if isinstance(body, dict) else {}
