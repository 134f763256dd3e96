"""A session's DAG run on the real engine (tiny model): the same greedy outputs as issuing the calls one by one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from distserve.config import CacheConfig, SamplingParams
from distserve.dataflow.executor import DataflowSession, VariableFailed
from distserve.dataflow.template import parse_call
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import LoadedModel, load_model
from distserve.runtime.threaded_client import ThreadedEngineClient

CACHE = CacheConfig(num_blocks=256, block_size=16)
GREEDY = {"temperature": 0, "max_gen_length": 6, "ignore_tokenizer_eos": True}


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture
def client(tiny: LoadedModel) -> Iterator[ThreadedEngineClient]:
    c = ThreadedEngineClient(LLMEngine(tiny, cache_config=CACHE))
    yield c
    c.close()


def out(name: str) -> dict[str, object]:
    return {"name": name, "is_output": True, "sampling_config": GREEDY}


def test_a_chain_and_a_fan_in_match_the_calls_issued_one_by_one(tiny: LoadedModel, client: ThreadedEngineClient) -> None:
    async def dataflow() -> tuple[str, str, str]:
        s = DataflowSession("s", client)
        a = s.submit(parse_call("Topic {{t}}. Idea: {{idea}} Detail: {{detail}}", [{"name": "t", "value": "bees"}, out("idea"), out("detail")]))
        b = s.submit(parse_call("Other: {{x}}", [out("x")]))
        c = s.submit(parse_call("{{i}} and {{x}} give {{y}}", [
            {"name": "i", "var_id": a.outputs["detail"].var_id}, {"name": "x", "var_id": b.outputs["x"].var_id}, out("y"),
        ]))
        y = await s.get(c.outputs["y"].var_id, "latency", timeout_s=60)
        return a.outputs["idea"].value or "", a.outputs["detail"].value or "", y

    idea, detail, y = asyncio.run(dataflow())
    # The same calls one request at a time, on a fresh engine, sent as ``dataflow.prompts`` documents:
    # <s> (the tiny tokenizer's encode adds it), each piece encoded alone, generated variables as their ids.
    engine = LLMEngine(tiny, cache_config=CACHE)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tok = engine.tokenizer
    assert tok.encode("x")[0] == tok.bos_token_id

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    def one(prompt: list[int]) -> tuple[str, list[int]]:
        o = engine.generate([prompt], sp)[0]
        ids = list(o.token_ids)
        while ids and ids[-1] in tok.skipped_token_ids:  # trailing eos is not part of the value
            ids.pop()
        return o.text, ids

    # A text piece's trailing space goes with a text value after it, and is a token of its own before generated ids.
    bos = [tok.bos_token_id]
    idea_prompt = bos + enc("Topic") + enc(" bees") + enc(". Idea:") + enc(" ")
    ref_idea, idea_ids = one(idea_prompt)
    ref_detail, detail_ids = one(idea_prompt + idea_ids + enc(" Detail:") + enc(" "))  # continues after the generated ids
    ref_x, x_ids = one(bos + enc("Other:") + enc(" "))
    assert (idea, detail) == (ref_idea, ref_detail)
    assert y == one(bos + detail_ids + enc(" and") + enc(" ") + x_ids + enc(" give") + enc(" "))[0]
    # The tiny model emits arbitrary bytes: its text does not re-tokenize to its ids, so a text
    # continuation would have sent other tokens (this test tells the two apart).
    assert enc(ref_idea) != idea_ids or enc(ref_detail) != detail_ids


def test_text_model_type_sends_the_rendered_string(tiny: LoadedModel, client: ThreadedEngineClient) -> None:
    async def dataflow() -> tuple[str, str]:
        s = DataflowSession("s", client)
        a = s.submit(parse_call("Topic {{t}}. Idea: {{idea}} Detail: {{detail}}", [{"name": "t", "value": "bees"}, out("idea"), out("detail")],
                                model_type="text"))
        detail = await s.get(a.outputs["detail"].var_id, "latency", timeout_s=60)
        return a.outputs["idea"].value or "", detail

    idea, detail = asyncio.run(dataflow())
    engine = LLMEngine(tiny, cache_config=CACHE)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref_idea = engine.generate(["Topic bees. Idea: "], sp)[0].text
    assert (idea, detail) == (ref_idea, engine.generate(["Topic bees. Idea: " + ref_idea + " Detail: "], sp)[0].text)


def test_a_stream_yields_the_generation_as_it_happens_and_late_readers_catch_up(client: ThreadedEngineClient) -> None:
    long = {"temperature": 0, "max_gen_length": 48, "ignore_tokenizer_eos": True}

    async def scenario() -> tuple[list[str], list[str], str]:
        s = DataflowSession("s", client)
        a = s.submit(parse_call("Tell {{story}}", [{"name": "story", "is_output": True, "sampling_config": long}]))
        var_id = a.outputs["story"].var_id
        early = [d async for d in s.stream(var_id, "latency", timeout_s=60)]
        late = [d async for d in s.stream(var_id, "latency", timeout_s=60)]
        return early, late, await s.get(var_id, "latency")

    early, late, value = asyncio.run(scenario())
    assert "".join(early) == value == "".join(late) and len(value) > 0
    assert len(early) > 1  # deltas while generating, not the value at the end
    assert late == [value]  # a reader after the end gets it all at once


def test_a_stream_of_a_failed_variable_raises_the_failure(client: ThreadedEngineClient) -> None:
    async def scenario() -> None:
        s = DataflowSession("s", client)
        a = s.submit(parse_call("Count: {{n}}", [out("n")]))
        b = s.submit(parse_call("{{num}} then {{m}}", [
            {"name": "num", "var_id": a.outputs["n"].var_id, "transforms": [{"op": "json_parse"}]}, out("m"),
        ]))
        with pytest.raises(VariableFailed, match=f"call {b.call_id} failed: json_parse"):
            async for _ in s.stream(b.outputs["m"].var_id, "latency", timeout_s=60):
                pass
        pending = s.graph.new_variable("never_set")
        with pytest.raises(TimeoutError):
            async for _ in s.stream(pending.var_id, "latency", timeout_s=0.05):
                pass
        assert s.num_readers == 0

    asyncio.run(scenario())


def test_a_failed_transform_fails_the_reader_and_downstream_without_hanging(client: ThreadedEngineClient) -> None:
    async def scenario() -> None:
        s = DataflowSession("s", client)
        a = s.submit(parse_call("Count: {{n}}", [out("n")]))
        b = s.submit(parse_call("{{num}} then {{m}}", [
            {"name": "num", "var_id": a.outputs["n"].var_id, "transforms": [{"op": "regex", "pattern": "^NEVER$"}]}, out("m"),
        ]))
        c = s.submit(parse_call("{{m}} so {{k}}", [{"name": "m", "var_id": b.outputs["m"].var_id}, out("k")]))
        with pytest.raises(VariableFailed, match=f"call {b.call_id} failed: regex"):
            await s.get(c.outputs["k"].var_id, "latency", timeout_s=60)
        assert a.outputs["n"].value is not None  # the producer itself succeeded
        pending = s.graph.new_variable("never_set")
        with pytest.raises(TimeoutError):
            await s.get(pending.var_id, "latency", timeout_s=0.05)
        await s.close()

    asyncio.run(scenario())


def test_an_input_set_later_releases_its_calls(client: ThreadedEngineClient) -> None:
    async def scenario() -> str:
        s = DataflowSession("s", client)
        a = s.submit(parse_call("Doc: {{doc}} Summary: {{sum}}", [{"name": "doc"}, out("sum")]), criteria="throughput")
        doc = a.inputs["doc"]
        assert not isinstance(doc, str)
        reading = asyncio.ensure_future(s.get(a.outputs["sum"].var_id, "throughput", timeout_s=60))
        await asyncio.sleep(0.05)
        assert not reading.done()
        await s.set(doc.var_id, "the quick brown fox")
        return await reading

    assert isinstance(asyncio.run(scenario()), str)


def test_an_engine_outage_fails_the_call_instead_of_leaving_it_running(client: ThreadedEngineClient) -> None:
    from distserve.errors import ServiceUnavailableError

    class Down:
        tokenizer = client.tokenizer

        def generate(self, *args: object, **kwargs: object) -> object:
            raise ServiceUnavailableError("no decode instance is alive")

    async def scenario() -> None:
        s = DataflowSession("s", Down())  # type: ignore[arg-type]
        a = s.submit(parse_call("Hi {{x}}", [out("x")]))
        with pytest.raises(VariableFailed, match=f"call {a.call_id} failed: ServiceUnavailableError: no decode instance"):
            await s.get(a.outputs["x"].var_id, "latency", timeout_s=10)

    asyncio.run(scenario())


class _ClassRecordingClient(ThreadedEngineClient):
    """The real in-process client, recording the scheduling class each request was sent with."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine)
        self.classes: dict[str, object] = {}

    def generate(self, prompt, sampling, request_id, priority=0, request_class=None, timeout_s=None):  # type: ignore[no-untyped-def]
        self.classes[request_id] = request_class
        return super().generate(prompt, sampling, request_id, priority, request_class=request_class)


@pytest.mark.parametrize("criteria", ["latency", "throughput"])
def test_requests_carry_the_deduced_objective_and_task_group(tiny: LoadedModel, criteria: str) -> None:
    from distserve.cluster.classes import RequestClass

    rec = _ClassRecordingClient(LLMEngine(tiny, cache_config=CACHE))
    try:
        async def run() -> tuple[str, str, str]:
            s = DataflowSession("s", rec)
            m1 = s.submit(parse_call("Part one {{a}}", [out("a")]))
            m2 = s.submit(parse_call("Part two {{b}}", [out("b")]))
            r = s.submit(parse_call("{{a}} {{b}} so {{c}}", [
                {"name": "a", "var_id": m1.outputs["a"].var_id}, {"name": "b", "var_id": m2.outputs["b"].var_id}, out("c"),
            ]))
            await s.get(r.outputs["c"].var_id, criteria, timeout_s=60)
            return m1.call_id, m2.call_id, r.call_id

        m1, m2, r = asyncio.run(run())
    finally:
        rec.close()
    # The mappers feed one consumer: a task group named after it, scheduled by the reader's objective
    # (latency reaches the producer's immediate predecessors; throughput marks every ancestor). The
    # consumer reads their outputs: it continues their work (not refused for load at admission).
    assert rec.classes[f"{m1}-a"] == RequestClass(criteria, group=r)
    assert rec.classes[f"{m2}-b"] == RequestClass(criteria, group=r)
    assert rec.classes[f"{r}-c"] == RequestClass(criteria, group=None, continues=True)


def test_calls_submitted_consumers_first_into_client_created_variables_run_as_in_order(tiny: LoadedModel) -> None:
    """The same DAG submitted producers first and consumers first: the same outputs, the same classes."""
    dag = {  # name -> (template, inputs by placeholder -> the call whose output it reads)
        "m0": ("Part one {{out}}", {}),
        "m1": ("Part two {{out}}", {}),
        "reduce": ("{{a}} {{b}} so {{out}}", {"a": "m0", "b": "m1"}),
        "title": ("Title: {{r}} is {{out}}", {"r": "reduce"}),
    }

    def run(order: list[str]) -> tuple[dict[str, str], dict[str, object]]:
        rec = _ClassRecordingClient(LLMEngine(tiny, cache_config=CACHE))
        try:
            async def scenario() -> tuple[dict[str, str], dict[str, object]]:
                s = DataflowSession("s", rec)
                var = {name: s.graph.new_variable(name).var_id for name in dag}
                nodes = {}
                for name in order:
                    template, reads = dag[name]
                    phs = [{"name": ph, "var_id": var[src]} for ph, src in reads.items()]
                    nodes[name] = s.submit(parse_call(template, [*phs, {**out("out"), "var_id": var[name]}]), "latency" if name == "title" else None)
                    assert nodes[name].outputs["out"].var_id == var[name]
                await s.get(var["title"], "latency", timeout_s=60)
                by_call = {n.call_id: name for name, n in nodes.items()}
                values = {name: s.graph.variables[var[name]].value or "" for name in dag}
                classes = {name: (rec.classes[f"{n.call_id}-out"].objective, by_call.get(rec.classes[f"{n.call_id}-out"].group))  # type: ignore[attr-defined]
                           for name, n in nodes.items()}
                return values, classes

            return asyncio.run(scenario())
        finally:
            rec.close()

    forward, backward = run(list(dag)), run(list(dag)[::-1])
    assert forward == backward
    values, classes = forward
    assert all(values.values())
    assert classes == {"m0": ("throughput", "reduce"), "m1": ("throughput", "reduce"), "reduce": ("latency", None), "title": ("latency", None)}
