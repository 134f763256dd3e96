"""Tool calls in a model's output: the parsers ``--tool-call-parser`` names (vLLM's names), chosen from a registry.

A parser turns the text a chat completion generated into ``content`` and ``tool_calls``. ``hermes``
reads Hermes-style calls, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes 2 Pro,
Qwen 2.5/3 and the templates that copy them), as vLLM's ``hermes`` parser does: the content is the
text before the first call, and if any call is not valid JSON naming a function, nothing is a call
and the whole text is content.

Streaming gives the same answer as the whole text would (``ToolCallStream``): content streams as it
arrives until a call may be starting (the text ends with a prefix of ``<tool_call>``); from the first
call on the text is held and parsed once the completion ends, then each call is sent whole (its id,
name and all of its arguments in one delta, which OpenAI's clients accumulate like any other).
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ParsedToolCall]


class ToolParser(abc.ABC):
    """Finds tool calls in a completion's text. A subclass names the tag that opens a call (``start``)."""

    start = ""

    @abc.abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """The content before the first call and every call in ``text``; no calls if any is malformed."""


class HermesToolParser(ToolParser):
    start = "<tool_call>"
    _call = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract(self, text: str) -> ExtractedToolCalls:
        if self.start not in text:
            return ExtractedToolCalls(text, [])
        calls: list[ParsedToolCall] = []
        for closed, unclosed in self._call.findall(text):
            call = _parse_call(closed or unclosed)
            if call is None:
                return ExtractedToolCalls(text, [])  # vLLM's rule: one bad call and none is a call
            calls.append(call)
        content = text[: text.find(self.start)]
        return ExtractedToolCalls(content or None, calls)


def _parse_call(body: str) -> ParsedToolCall | None:
    """``{"name": str, "arguments": object}`` (``parameters`` accepted too), or None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models send the arguments as JSON text already
        try:
            json.loads(arguments)
        except ValueError:
            return None
        return ParsedToolCall(obj["name"], arguments)
    return ParsedToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class ForcedToolCallParser(ToolParser):
    """The output of a forced call (``tool_choice`` "required" or a named function), decoded under the
    calls' JSON schema (``serving.structured_request.tool_call_output``): the named function's arguments,
    or a list of ``{"name", "parameters"}``. The whole output is the call(s), so nothing streams as content
    (``start`` is empty); output that is not complete JSON (cut by ``max_tokens``) is content, no call."""

    start = ""

    def __init__(self, function_name: str | None = None) -> None:
        self.function_name = function_name

    def extract(self, text: str) -> ExtractedToolCalls:
        try:
            obj = json.loads(text)
        except ValueError:
            return ExtractedToolCalls(text, [])
        if self.function_name is not None:
            if isinstance(obj, dict):
                return ExtractedToolCalls(None, [ParsedToolCall(self.function_name, text)])
            return ExtractedToolCalls(text, [])
        calls = [_parse_call(json.dumps(item, ensure_ascii=False)) for item in obj] if isinstance(obj, list) else []
        if not calls or any(c is None for c in calls):
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(None, [c for c in calls if c is not None])


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


class ToolCallStream:
    """One streamed completion through ``parser``: ``feed`` each new text, ``finish`` at its end."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._sent = 0  # chars of ``text`` sent as content
        self._held = False  # a call started: everything from ``_sent`` on waits for ``finish``

    def feed(self, delta: str) -> str:
        """The content that may be sent now."""
        self.text += delta
        if self._held:
            return ""
        start = self.text.find(self.parser.start, self._sent)
        if start != -1:
            self._held = True
            end = start
        else:
            end = len(self.text) - _partial_suffix(self.text, self.parser.start)
        out = self.text[self._sent : end]
        self._sent = max(self._sent, end)
        return out

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """The rest of the content and the tool calls, as ``parser.extract`` reads the whole text."""
        extracted = self.parser.extract(self.text)
        if not extracted.tool_calls:
            rest = self.text[self._sent :]
        else:
            rest = (extracted.content or "")[self._sent :]
        self._sent = len(self.text)
        return rest, extracted.tool_calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (it may become ``tag``)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


__all__ = ["ExtractedToolCalls", "ForcedToolCallParser", "HermesToolParser", "ParsedToolCall", "TOOL_PARSERS", "ToolCallStream", "ToolParser", "get_tool_parser"]
