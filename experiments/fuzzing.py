"""Property-based fuzzing of a running distserve server, by route family (shared by ``fuzz_report.py`` and any
script that wants the same figures, e.g. a chaos run: ``fuzz_server(base_url, per_family)``).

Every route in ``/openapi.json`` is fuzzed by schemathesis (requests that fit the schema and requests that do not),
and hypothesis strategies reach what the schema cannot describe: semantic-variable programs (sessions, variables,
templates, placeholders, transforms, reads with timeouts), structured-output specs (random JSON schemas, regexes,
choices, grammars), ``/tokenize`` bodies and odd or hostile headers. Each request has a deadline; a response is
counted by status, a request that outlived its deadline is a hang. Nothing stops at a 5xx: the report counts them
and keeps a few examples.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

FAMILIES = ("completions", "chat", "semantic", "structured", "ops", "headers")
PLAIN = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
NASTY_STRINGS = ["", " ", "\x00", "\ud800", "\udfff x", "{{x}}", "{{ 7*7 }}", "{% for x in y %}", "\u202e", "😀" * 20, "a" * 5000,
                 "<|im_start|>", "\\", '"', "null", "-1", "1e309", "NaN", "../../etc/passwd", "$(id)", "' OR 1=1 --"]
NASTY_REGEXES = ["(a|aa)*b", "((a{1000}){1000}){1000}", "(a{300}){300}", "(x+x+)+y", "[", "(?P<x>", "\\", "a{2,1}", "(?<=a+)b",
                 ".*" * 50, "(" * 300 + "a" + ")" * 300, "[\\w\\W]{1,100000}", "\\p{L}+", "(?i)(?s).{0,10}"]
NASTY_GRAMMARS = ['root ::= "a" root | "b"', "root ::= x\nx ::= x", 'start: "a"+', "root ::= [", "::=", "root ::= " + " | ".join(
    f'"w{i}"' for i in range(2000))]


@dataclass
class FamilyTally:
    """What one family's requests got back."""

    num_requests: int = 0
    by_status: Counter[str] = field(default_factory=Counter)  # "200", "400", ..., "hang", "error:<type>"
    examples_5xx: list[str] = field(default_factory=list)
    examples_other: list[str] = field(default_factory=list)  # hangs and requests that got no HTTP answer
    generator_errors: list[str] = field(default_factory=list)  # the fuzzer's own failures (not the server's)
    seconds: float = 0.0

    def record(self, status: int | str, what: str) -> None:
        self.num_requests += 1
        self.by_status[str(status)] += 1
        if (isinstance(status, int) and status >= 500) and len(self.examples_5xx) < 5:
            self.examples_5xx.append(what[:600])
        if isinstance(status, str) and len(self.examples_other) < 5:
            self.examples_other.append(f"{status}: {what[:600]}")

    @property
    def num_5xx(self) -> int:
        return sum(n for s, n in self.by_status.items() if s.isdigit() and int(s) >= 500)

    @property
    def num_hangs(self) -> int:
        return self.by_status.get("hang", 0)

    def summary(self) -> dict[str, Any]:
        return {"num_requests": self.num_requests, "by_status": dict(sorted(self.by_status.items())), "num_5xx": self.num_5xx,
                "num_hangs": self.num_hangs, "num_2xx": sum(n for s, n in self.by_status.items() if s.startswith("2")),
                "num_4xx": sum(n for s, n in self.by_status.items() if s.startswith("4")),
                "examples_5xx": self.examples_5xx, "examples_other": self.examples_other, "generator_errors": self.generator_errors, "seconds": round(self.seconds, 1)}


def family_of(path: str) -> str:
    if path == "/v1/completions":
        return "completions"
    if path == "/v1/chat/completions":
        return "chat"
    if path.startswith(("/v1/session", "/v1/semantic", "/v1/py_native_call")):
        return "semantic"
    return "ops"


def _outcome(exc: BaseException) -> str:
    name = type(exc).__name__
    return "hang" if "Timeout" in name else f"error:{name}"


# ---- schemathesis over the OpenAPI schema ------------------------------------------------------------
def fuzz_openapi(base_url: str, per_family: int, tallies: dict[str, FamilyTally], deadline_s: float, rng_seed: int) -> None:
    """Schemathesis cases for every operation, fitting the schema and not, about ``per_family`` per family in all."""
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    per_family_ops = Counter(family_of(op.path) for op in operations)
    for operation in operations:
        family = family_of(operation.path)
        tally = tallies[family]
        examples = max(1, per_family // (2 * per_family_ops[family]))
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @seed(rng_seed)
            @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                t0 = time.monotonic()
                what = f"{operation.method.upper()} {operation.path} {json.dumps(case.body, default=str)[:400] if case.body is not None else ''}"
                try:
                    response = case.call(base_url=base_url, timeout=deadline_s)
                    tally.record(response.status_code, what + f" -> {response.text[:200]}")
                except Exception as exc:  # noqa: BLE001 - counted, never fatal
                    tally.record(_outcome(exc), what)
                tally.seconds += time.monotonic() - t0

            try:
                run()
            except Unsatisfiable:
                pass  # no request violates a route without parameters


# ---- hypothesis strategies for what the schema cannot describe ---------------------------------------
text = st.one_of(st.text(max_size=40), st.sampled_from(NASTY_STRINGS))
json_value = st.recursive(st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats(allow_nan=False) | text,
                          lambda c: st.lists(c, max_size=4) | st.dictionaries(text, c, max_size=4), max_leaves=12)


def _schema_children(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    names = st.sampled_from(["a", "b", "name", "x y", "$ref", ""])
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(names, children, max_size=4)},
                              optional={"required": st.lists(names, max_size=3), "additionalProperties": st.booleans()}),
        st.fixed_dictionaries({"type": st.just("array"), "items": children},
                              optional={"minItems": st.integers(-1, 50), "maxItems": st.integers(-1, 50)}),
        st.fixed_dictionaries({"anyOf": st.lists(children, min_size=1, max_size=4)}),
        st.fixed_dictionaries({"allOf": st.lists(children, min_size=1, max_size=3)}),
    )


json_schema = st.recursive(
    st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object", "array", "bogus"])}),
        st.fixed_dictionaries({"type": st.just("string")}, optional={"pattern": st.sampled_from(NASTY_REGEXES) | text,
                                                                     "minLength": st.integers(-5, 300), "maxLength": st.integers(-5, 300),
                                                                     "format": st.sampled_from(["date-time", "email", "uuid", "x"])}),
        st.fixed_dictionaries({"type": st.just("integer")}, optional={"minimum": st.integers(-10**30, 10**30), "maximum": st.integers(-10**30, 10**30)}),
        st.fixed_dictionaries({"enum": st.lists(json_value, min_size=0, max_size=5)}),
        st.fixed_dictionaries({"$ref": st.sampled_from(["#", "#/definitions/x", "http://example.invalid/s.json"])}),
        json_value,
    ),
    _schema_children, max_leaves=15,
)


def structured_fields() -> st.SearchStrategy[dict[str, Any]]:
    regex = st.sampled_from(NASTY_REGEXES) | text | st.sampled_from([r"[a-c]{2,5}-[0-9]{2}", r"\d+", "yes|no"])
    return st.one_of(
        st.fixed_dictionaries({"response_format": st.one_of(
            st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"name": text, "schema": json_schema})}),
            st.fixed_dictionaries({"type": st.sampled_from(["json_object", "text", "bogus"])}), json_value)}),
        st.fixed_dictionaries({"guided_json": json_schema | st.builds(json.dumps, json_schema) | text}),
        st.fixed_dictionaries({"guided_regex": regex}),
        st.fixed_dictionaries({"guided_choice": st.lists(text, max_size=6) | json_value}),
        st.fixed_dictionaries({"guided_grammar": st.sampled_from(NASTY_GRAMMARS) | text}),
        st.fixed_dictionaries({"structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "x"]),
                                                                     json_schema | regex | st.booleans(), max_size=2)}),
        st.fixed_dictionaries({"guided_regex": regex, "guided_json": json_schema}),  # two constraints
        st.fixed_dictionaries({"tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g"]), "parameters": json_schema})}), max_size=2),
            "tool_choice": st.sampled_from(["required", "auto", "none"]) | json_value}),
    )


@st.composite
def structured_request(draw: st.DrawFn) -> tuple[str, str, dict[str, Any]]:
    fields = draw(structured_fields())
    sampling = {"max_tokens": draw(st.integers(1, 12)), "temperature": draw(st.sampled_from([0, 0.7]))}
    if "tools" in fields or draw(st.booleans()):
        return "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": draw(text)}], **sampling, **fields}
    return "POST", "/v1/completions", {"prompt": draw(text) or "x", **sampling, **fields}


@st.composite
def ops_request(draw: st.DrawFn) -> tuple[str, str, Any]:
    kind = draw(st.sampled_from(["tokenize_prompt", "tokenize_chat", "tokenize_any", "detokenize", "get"]))
    if kind == "tokenize_prompt":
        return "POST", "/tokenize", {"prompt": draw(text | st.lists(st.integers(-5, 2**40), max_size=8)),
                                     "add_special_tokens": draw(st.booleans() | json_value), "return_token_strs": draw(st.booleans())}
    if kind == "tokenize_chat":
        messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]), "content": text | json_value}),
                            max_size=4)
        return "POST", "/tokenize", {"messages": draw(messages | json_value), "add_generation_prompt": draw(st.booleans()),
                                     "continue_final_message": draw(st.booleans()), "chat_template_kwargs": draw(json_value)}
    if kind == "tokenize_any":
        return "POST", "/tokenize", draw(json_value)
    if kind == "detokenize":
        return "POST", "/detokenize", {"tokens": draw(st.lists(st.integers(-2**70, 2**70) | st.integers(0, 300), max_size=20) | json_value)}
    method, path = draw(st.sampled_from([("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics"), ("GET", "/version"),
                                         ("GET", "/ping"), ("POST", "/ping"), ("GET", "/openapi.json"), ("GET", "/no/such"),
                                         ("DELETE", "/v1/models"), ("GET", "/v1/models/../../etc")]))
    return method, path, None


TRANSFORM = st.one_of(
    st.fixed_dictionaries({"op": st.just("regex"), "pattern": st.sampled_from(NASTY_REGEXES) | text}, optional={"group": json_value}),
    st.fixed_dictionaries({"op": st.sampled_from(["strip", "json_parse", "json_path", "split", "join", "truncate_tokens", "eval", "python"])},
                          optional={"path": text, "sep": text, "index": json_value, "max_tokens": json_value, "chars": text, "code": text}),
    json_value,
)
SAMPLING = st.fixed_dictionaries({}, optional={"max_gen_length": st.integers(-1, 8), "temperature": st.sampled_from([0, 1, -1, 1e9]),
                                               "ignore_tokenizer_eos": st.booleans(), "stop_str": text, "top_k": json_value,
                                               "n": st.integers(0, 3)})


@st.composite
def semantic_request(draw: st.DrawFn) -> tuple[str, str, Any]:
    """One request of a semantic-variable program; ``$SID``, ``$AUTH`` and ``$VAR`` are filled in when it is sent."""
    auth = draw(st.sampled_from([{"session_id": "$SID", "session_auth": "$AUTH"}] * 4 + [{"session_id": "$SID", "session_auth": "wrong"},
                                                                                         {"session_id": "$SID"}]) | json_value)
    if not isinstance(auth, dict):
        auth = {"session_id": auth, "session_auth": "$AUTH"}
    var = quote(draw(st.sampled_from(["$VAR", "$VAR", "s0-v0", "../x", "", "%00"]) | text).encode("utf-8", "surrogatepass"), safe="$")
    read = {"timeout": draw(st.sampled_from([0.05, 0.2, 0.5]) | st.sampled_from([0, -1, "x", 1e9, None])),
            "criteria": draw(st.sampled_from(["latency", "throughput"]) | text)}
    kind = draw(st.sampled_from(["call", "call", "call", "var", "set", "get", "stream", "list", "info", "delete", "native", "new"]))
    if kind == "call":
        names = st.sampled_from(["a", "b", "out", "x-y", ""])
        placeholder = st.fixed_dictionaries({"name": names, "is_output": st.booleans()},
                                            optional={"value": text, "var_id": st.just("$VAR") | text, "transforms": st.lists(TRANSFORM, max_size=3),
                                                      "sampling_config": SAMPLING})
        template = draw(st.sampled_from(["Say {{a}} then {{out}}", "{{a}}{{b}} {{out}}", "{{out}}", "{{ a }} {{out}}", "{{out}}{{b}}"]) | text)
        body = {**auth, "template": template, "placeholders": draw(st.lists(placeholder, max_size=4) | json_value),
                "model_type": draw(st.sampled_from(["token_id", "text"]) | text)}
        if draw(st.booleans()):
            body["output_criteria"] = draw(st.sampled_from(["latency", "throughput", None]) | text)
        return "POST", "/v1/semantic_call", body
    if kind == "var":
        return "POST", "/v1/semantic_var", {**auth, "var_name": draw(text | json_value)}
    if kind == "set":
        return "POST", f"/v1/semantic_var/{var}", {**auth, "content": draw(text | json_value)}
    if kind in ("get", "stream"):
        return "GET", f"/v1/semantic_var/{var}{'/stream' if kind == 'stream' else ''}", {**auth, **read}
    if kind == "list":
        return "GET", "/v1/semantic_var", auth
    if kind == "info":
        return "GET", "/v1/session/$SID", auth
    if kind == "delete":
        return "DELETE", "/v1/session/$SID", auth
    if kind == "native":
        return "POST", "/v1/py_native_call", draw(json_value)
    return "POST", "/v1/session", draw(json_value)


def _field_value(raw: bytes) -> bytes:
    """``raw`` as bytes any HTTP client may send in a header value (no control characters, no edge blanks)."""
    return bytes(c for c in raw if c == 9 or 32 <= c <= 126 or c >= 128).strip(b" \t") or b"x"


HEADER_VALUE = st.one_of(text.map(lambda s: _field_value(s.encode("utf-8", "surrogatepass"))), st.binary(max_size=40).map(_field_value),
                         st.integers(0, 200_000).map(lambda n: b"a" * max(1, n)))


@st.composite
def header_request(draw: st.DrawFn) -> tuple[str, str, Any, dict[bytes, bytes]]:
    headers: dict[bytes, bytes] = {}
    for name in draw(st.lists(st.sampled_from([b"x-request-id", b"authorization", b"content-type", b"accept", b"accept-encoding",
                                               b"origin", b"cookie", b"x-forwarded-for", b"user-agent", b"x-odd"]), max_size=5)):
        headers[name] = draw(HEADER_VALUE)
    for i in range(draw(st.sampled_from([0, 0, 0, 10, 300]))):
        headers[b"x-many-%d" % i] = b"1"
    method, path = draw(st.sampled_from([("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/v1/session")]))
    body = {**PLAIN, "max_tokens": 1} if path == "/v1/completions" else {"prompt": "hi"} if path == "/tokenize" else None
    return method, path, body, headers


# ---- sending ---------------------------------------------------------------------------------------
class SemanticState:
    """The live sessions and variables a semantic program's requests refer to."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http
        self.session: dict[str, Any] = {}
        self.vars: list[str] = ["s1-v0"]

    def ensure_session(self) -> None:
        if not self.session:
            resp = self.http.post("/v1/session")
            if resp.status_code == 200:
                self.session = resp.json()

    def fill(self, value: Any, index: int) -> Any:
        if isinstance(value, str):
            return (value.replace("$SID", str(self.session.get("session_id", 0))).replace("$AUTH", str(self.session.get("session_auth", "")))
                    .replace("$VAR", self.vars[index % len(self.vars)]))
        if isinstance(value, dict):
            return {k: self.fill(v, index) for k, v in value.items()}
        if isinstance(value, list):
            return [self.fill(v, index) for v in value]
        return value

    def learn(self, method: str, path: str, response: httpx.Response) -> None:
        if response.status_code != 200 or not response.headers.get("content-type", "").startswith("application/json"):
            return
        data = response.json()
        if path == "/v1/semantic_var" and method == "POST":
            self.vars.append(data["var_id"])
        elif path == "/v1/semantic_call":
            self.vars.extend(p["var_id"] for p in data.get("param_info", []))
        elif method == "DELETE":
            self.session = {}
        self.vars = self.vars[-50:]


def send(http: httpx.Client, method: str, path: str, body: Any, headers: dict[Any, Any] | None = None) -> httpx.Response:
    """One request; a ``/stream`` response is read to its end (within the client's deadline)."""
    content = None if body is None else json.dumps(body).encode()
    hdrs = {"content-type": "application/json", **(headers or {})} if content is not None else (headers or {})
    request = http.build_request(method, path, content=content, headers=hdrs)
    response = http.send(request, stream=True)
    try:
        response.read()
    finally:
        response.close()
    return response


def fuzz_strategy(base_url: str, family: str, strategy: st.SearchStrategy[Any], target: int, tally: FamilyTally, deadline_s: float,
                  rng_seed: int) -> None:
    """Requests drawn from ``strategy`` until ``tally`` holds ``target`` requests."""
    with httpx.Client(base_url=base_url, timeout=deadline_s, trust_env=False) as http:
        state = SemanticState(http)
        batch = 0
        while tally.num_requests < target:
            n = target - tally.num_requests
            batch += 1

            @seed(rng_seed * 1000 + batch)
            @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(item=strategy, index=st.integers(0, 1000))
            def run(item: Any, index: int) -> None:
                method, path, body, *rest = item
                headers = rest[0] if rest else None
                if family == "semantic":
                    state.ensure_session()
                    path, body = state.fill(path, index), state.fill(body, index)
                t0 = time.monotonic()
                what = f"{method} {path} {json.dumps(body, default=str)[:400]} headers={str(headers)[:200] if headers else ''}"
                try:
                    response = send(http, method, path, body, headers)
                    tally.record(response.status_code, what + f" -> {response.text[:200]}")
                    if family == "semantic":
                        state.learn(method, path, response)
                except Exception as exc:  # noqa: BLE001 - counted, never fatal
                    tally.record(_outcome(exc), what)
                tally.seconds += time.monotonic() - t0

            before = tally.num_requests
            try:
                run()
            except Exception as exc:  # noqa: BLE001 - a generator's own bug must not end the run: next batch, new seed
                tally.generator_errors.append(f"{type(exc).__name__}: {exc}"[:300])
                if len(tally.generator_errors) >= 5:
                    break
                continue
            if tally.num_requests == before:
                break


STRATEGIES: dict[str, Callable[[], st.SearchStrategy[Any]]] = {
    "completions": lambda: st.tuples(st.just("POST"), st.just("/v1/completions"), st.fixed_dictionaries(
        {"prompt": text | st.lists(st.integers(-10, 2**64), max_size=6)}, optional={
            "max_tokens": st.integers(-1, 200) | json_value, "n": st.integers(0, 200), "logit_bias": json_value, "stop": json_value,
            "seed": st.integers(-2**70, 2**70), "logprobs": json_value, "echo": st.booleans(), "stream": st.booleans(),
            "priority": st.integers(-2**70, 2**70), "timeout": json_value, "truncate_prompt_tokens": json_value})),
    "chat": lambda: st.tuples(st.just("POST"), st.just("/v1/chat/completions"), st.fixed_dictionaries(
        {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus"]),
                                                     "content": text | json_value}), max_size=4) | json_value},
        optional={"max_tokens": st.integers(-1, 40), "max_completion_tokens": json_value, "stream": st.booleans(), "n": st.integers(0, 9),
                  "chat_template_kwargs": json_value, "tools": json_value, "tool_choice": json_value, "top_logprobs": json_value,
                  "logprobs": st.booleans(), "continue_final_message": st.booleans(), "add_generation_prompt": st.booleans()})),
    "semantic": semantic_request,
    "structured": structured_request,
    "ops": ops_request,
    "headers": header_request,
}


def fuzz_server(base_url: str, per_family: int, deadline_s: float = 30.0, rng_seed: int = 0, families: tuple[str, ...] = FAMILIES,
                on_progress: Callable[[str, dict[str, FamilyTally]], None] | None = None) -> dict[str, FamilyTally]:
    """At least ``per_family`` generated requests per family against the server at ``base_url`` (no ``/v1``);
    ``on_progress(stage, tallies)`` after the schema's cases and after each family."""
    tallies = {f: FamilyTally() for f in FAMILIES}
    fuzz_openapi(base_url, per_family // 2, tallies, deadline_s, rng_seed)  # half from the schema, the rest below
    if on_progress is not None:
        on_progress("openapi", tallies)
    for family in families:
        fuzz_strategy(base_url, family, STRATEGIES[family](), per_family, tallies[family], deadline_s, rng_seed)
        if on_progress is not None:
            on_progress(family, tallies)
    return {f: tallies[f] for f in families}


__all__ = ["FAMILIES", "FamilyTally", "fuzz_server"]
