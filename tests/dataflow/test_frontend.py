"""Our Python frontend against a real server: ``@semantic_function`` programs run as a server-side DAG."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from serving_util import HttpServer, colocated_server

from distserve.config import CacheConfig, SamplingParams
from distserve.dataflow.frontend import DataflowClientError, Input, Output, Session, semantic_function
from distserve.engine.llm_engine import LLMEngine
from distserve.engine.weights import load_model

pytestmark = pytest.mark.timeout(300)
CACHE = CacheConfig(num_blocks=256, block_size=16)


@semantic_function
def summarize(doc: Input, summary: Output(max_tokens=5, temperature=0, ignore_eos=True)):  # type: ignore[valid-type]
    """Document: {{doc}}
    Summary: {{summary}}"""


@semantic_function
def title(text: Input(transforms=[{"op": "strip"}]), headline: Output(max_gen_length=4, temperature=0, ignore_tokenizer_eos=True)):  # type: ignore[valid-type]
    """Summary: {{text}}
    Title: {{headline}}"""


@pytest.fixture(scope="module")
def server() -> Iterator[HttpServer]:
    srv = colocated_server(CACHE)
    yield srv
    srv.stop()


def test_a_frontend_program_matches_the_calls_made_one_by_one(server: HttpServer) -> None:
    assert summarize.template == "Document: {{doc}}\nSummary: {{summary}}"
    with Session(server.url) as s:
        doc = s.variable("doc")
        headline = title(s, text=summarize(s, doc=doc))
        assert isinstance(headline, type(doc))
        doc.set("bees make honey")
        got = headline.get(perf="latency")
        again = asyncio.run(headline.aget(perf="throughput"))
    # Text prompts send the same ids here: client-set and transformed inputs are encoded as text, and
    # the tiny tokenizer (one token per byte) has no merges across piece boundaries.
    engine = LLMEngine(load_model("tiny"), cache_config=CACHE)
    s1 = engine.generate(["Document: bees make honey\nSummary: "], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].text
    ref = engine.generate([f"Summary: {s1.strip()}\nTitle: "], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].text
    assert got == again == ref


def test_a_variable_streams_in_pieces_that_join_into_its_value(server: HttpServer) -> None:
    @semantic_function
    def story(topic: Input, text: Output(max_tokens=40, temperature=0, ignore_eos=True)):  # type: ignore[valid-type]
        """A story about {{topic}}: {{text}}"""

    async def both(var: Any) -> list[str]:
        return [piece async for piece in var.astream()]

    with Session(server.url) as s:
        text = story(s, topic="bees")
        pieces = list(text.stream(perf="latency"))
        assert len(pieces) > 1 and "".join(pieces) == text.get()
        assert "".join(asyncio.run(both(text))) == text.get()  # a late reader gets the same text
        failing = title(s, text=s.variable("never"))
        with pytest.raises(DataflowClientError) as err:
            list(failing.stream(timeout_s=0.1))
        assert err.value.status == 408
        with pytest.raises(DataflowClientError) as err:
            list(failing.stream(perf="soon"))
        assert err.value.status == 400 and err.value.param == "criteria"


def test_frontend_errors_carry_the_server_status(server: HttpServer) -> None:
    with Session(server.url) as s:
        with pytest.raises(TypeError, match="missing"):
            summarize(s)
        pending = s.variable("never")
        with pytest.raises(DataflowClientError) as err:
            pending.get(timeout_s=0.05)
        assert err.value.status == 408
        with pytest.raises(TypeError, match="template as its docstring"):
            semantic_function(lambda x: x)

        def unannotated(x):  # type: ignore[no-untyped-def]
            """{{x}}"""

        with pytest.raises(TypeError, match="annotated Input or Output"):
            semantic_function(unannotated)
