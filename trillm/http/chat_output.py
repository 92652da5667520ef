"""One chat choice's text, split into reasoning, content and tool calls, streamed or whole.

The text goes through the reasoning parser first (reasoning comes before the answer), then
what is content goes through the tool-call reader of the request's tool_choice. The same
object serves a stream (`feed` per delta, `finish` at the end) and a whole answer (one feed,
then finish), so both forms carry the same fields.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from trillm.http.protocol.chat import NamedToolChoice
from trillm.http.reasoning import ReasoningParser, reasoning_parser
from trillm.http.tool_parsers import TOOL_PARSERS, ToolCall, call_from_json
from trillm.engine.api import FinishReason


class PlainText:
    """tool_choice none: all content."""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return text, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        return "", []


class ForcedCall:
    """tool_choice required or named: the constrained output is one call. Named, it is the
    arguments object, streamed as it comes (the same call again, its arguments grown); an
    output cut short by max_tokens still yields the call, its arguments cut short too, as
    with OpenAI. Required, it is `{"name", "arguments"}`, read at the end."""

    def __init__(self, name: str | None):
        self._name = name
        self._text = ""
        self._call = ToolCall(name, "") if name is not None else None

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._text += text
        if self._call is None or not text:
            return "", []
        self._call.arguments += text
        return "", [self._call]

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self._call is not None:
            return "", [self._call]  # once more: a call whose arguments never came still is one
        try:
            call = call_from_json(json.loads(self._text))
        except ValueError:  # not JSON, or an integer longer than Python converts
            call = None
        return ("", [call]) if call is not None else (self._text, [])


def chat_output(reasoning: str | None, tools: str | None, choice: str | NamedToolChoice,
                parallel_tool_calls: bool | None, stream_reasoning: bool = True,
                include_reasoning: bool = True) -> ChatOutput:
    """One choice's splitter: the reasoning and tool-call parsers (names, or None), the
    request's effective tool_choice, its parallel_tool_calls (false: at most one call) and
    SGLang's stream_reasoning (false: the reasoning is held back until it ends, then sent whole);
    vLLM's include_reasoning (false: the reasoning is parsed out and not sent at all)."""
    return ChatOutput(reasoning_parser(reasoning) if reasoning else None, _tool_reader(choice, tools),
                      max_calls=1 if parallel_tool_calls is False else None, hold_reasoning=not stream_reasoning,
                      drop_reasoning=not include_reasoning)


def _tool_reader(choice: str | NamedToolChoice, parser: str | None):
    if isinstance(choice, NamedToolChoice):
        return ForcedCall(choice.function.name)
    if choice == "required":
        return ForcedCall(None)
    if choice == "auto":
        return TOOL_PARSERS[parser]()
    return PlainText()


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's delta shape, with `index`

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def __add__(self, later: ChatDelta) -> ChatDelta:
        return ChatDelta(self.reasoning + later.reasoning, self.content + later.content,
                         self.tool_calls + later.tool_calls)


class ChatOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools, max_calls: int | None = None,
                 hold_reasoning: bool = False, drop_reasoning: bool = False):
        """`max_calls`: calls past this many are dropped (parallel_tool_calls false), as a
        client that asked for one call would not know what to do with a second.
        `hold_reasoning`: the reasoning comes out in one piece, with the first content or at the end.
        `drop_reasoning`: the reasoning never comes out."""
        self._reasoning_parser = reasoning
        self._tools = tools
        self._max_calls = max_calls
        self._hold_reasoning = hold_reasoning
        self._drop_reasoning = drop_reasoning
        self._held_reasoning = ""
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[ToolCall] = []
        self._sent: dict[str, tuple[int, int]] = {}  # call id -> (index, length of arguments sent)

    @property
    def has_reasoning(self) -> bool:
        return self._reasoning_parser is not None

    def feed(self, text: str) -> ChatDelta:
        reasoning, content = self._reasoning_parser.feed(text) if self._reasoning_parser else ("", text)
        return self._record(self._release(reasoning, ended=bool(content)), *self._tools.feed(content))

    def finish(self) -> ChatDelta:
        """Everything still held back; call once, after the last feed."""
        reasoning, content = self._reasoning_parser.finish() if self._reasoning_parser else ("", "")
        content, calls = self._tools.feed(content)
        rest, more = self._tools.finish()
        return self._record(self._release(reasoning, ended=True), content + rest, calls + more)

    def _release(self, reasoning: str, ended: bool) -> str:
        """The reasoning to send now: all of it, unless held until it `ended` (content began) or
        dropped."""
        if self._drop_reasoning:
            return ""
        if not self._hold_reasoning:
            return reasoning
        self._held_reasoning += reasoning
        if not ended:
            return ""
        reasoning, self._held_reasoning = self._held_reasoning, ""
        return reasoning

    def finish_reason(self, reason: FinishReason | None) -> FinishReason | None:
        """A choice that ended naturally with calls ends for them."""
        return FinishReason.TOOL_CALLS if reason == FinishReason.STOP and self.tool_calls else reason

    def message(self) -> dict:
        """The whole answer's message fields. Content around tool calls that is only whitespace is none."""
        content = self.content if self.content.strip() or not self.tool_calls else None
        message = {"role": "assistant", "content": content}
        if self.has_reasoning:
            message["reasoning_content"] = self.reasoning or None
        if self.tool_calls:
            message["tool_calls"] = [_call_dict(c) for c in self.tool_calls]
        return message

    def _record(self, reasoning: str, content: str, calls: list[ToolCall]) -> ChatDelta:
        """A reader returns new calls, or one it returned before with its arguments grown: the
        delta of a new call carries all of it, that of a known one only the new arguments."""
        self.reasoning += reasoning
        self.content += content
        deltas = []
        for call in calls:
            if call.id in self._sent:
                index, sent = self._sent[call.id]
                if len(call.arguments) > sent:
                    deltas.append({"index": index, "function": {"arguments": call.arguments[sent:]}})
            elif self._max_calls is not None and len(self.tool_calls) >= self._max_calls:
                continue
            else:
                index = len(self.tool_calls)
                self.tool_calls.append(call)
                deltas.append({"index": index, **_call_dict(call)})
            self._sent[call.id] = (index, len(call.arguments))
        return ChatDelta(reasoning, content, deltas)


def _call_dict(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
