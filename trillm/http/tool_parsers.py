"""Tool-call parsers: a model's free-text tool calls picked out of its output (`tool_choice: auto`).

Chosen by `--tool-call-parser`, or else by `default_parser` from the chat template:

  hermes       Hermes / Qwen: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
               anywhere in the text; the text around the calls is content.
  llama3_json  Llama 3: the whole output is one call `{"name": ..., "parameters": {...}}` (or
               several separated by `;`); an output that does not begin with `{` is content.

Both are streaming-aware: `feed` returns the content that is safe to emit and the calls that
completed, holding back text that may still become a call; `finish` settles the rest. A call
that does not parse is given back as content, so nothing the model wrote is lost.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from trillm.engine.api import held_prefix_len


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def call_from_json(value, arguments_key: str = "arguments") -> ToolCall | None:
    """A call from a decoded `{"name": str, <arguments_key>: object}`, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self):
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content, calls = "", []
        while True:
            if not self._in_call:
                at = self._buffer.find(self.START)
                if at == -1:
                    cut = len(self._buffer) - held_prefix_len(self._buffer, [self.START])
                    content, self._buffer = content + self._buffer[:cut], self._buffer[cut:]
                    return content, calls
                content += self._buffer[:at]
                self._buffer, self._in_call = self._buffer[at + len(self.START):], True
            at = self._buffer.find(self.END)
            if at == -1:
                return content, calls
            body, self._buffer, self._in_call = self._buffer[:at], self._buffer[at + len(self.END):], False
            call = _parse_call(body, "arguments")
            if call is None:
                content += self.START + body + self.END
            else:
                calls.append(call)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """An unclosed call (the output was cut, or the model stopped before its end tag) still
        counts when its JSON is whole."""
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            return rest, []
        self._in_call = False
        call = _parse_call(rest, "arguments")
        return ("", [call]) if call is not None else (self.START + rest, [])


class Llama3JsonParser:
    def __init__(self):
        self._buffer = ""
        self._json: bool | None = None  # decided by the first character that is not whitespace

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._json is None:
            self._buffer += text
            head = self._buffer.lstrip()
            if not head:
                return "", []
            self._json = head.startswith("{")
            text, self._buffer = ("", self._buffer) if self._json else (self._buffer, "")
        elif self._json:
            self._buffer += text
            return "", []
        return text, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buffer = self._buffer, ""
        if not self._json:
            return rest, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            while at < len(rest) and rest[at] in " \t\r\n;":
                at += 1
            if at == len(rest):
                return "", calls
            try:
                value, at = decoder.raw_decode(rest, at)
            except ValueError:  # not JSON, or an integer longer than Python converts
                return rest, []
            call = call_from_json(value, "parameters" if "parameters" in value else "arguments")
            if call is None:
                return rest, []
            calls.append(call)


def _parse_call(body: str, arguments_key: str) -> ToolCall | None:
    try:
        return call_from_json(json.loads(body), arguments_key)
    except ValueError:  # not JSON, or an integer longer than Python converts
        return None


TOOL_PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def default_parser(chat_template: str | None) -> str | None:
    """The parser that reads the calls a model with this chat template writes: hermes where the
    template writes `<tool_call>` blocks or knows no tools (trillm then shows the tools in the
    Hermes format, trillm.http.tools), llama3_json for a Llama 3 template; None for a template
    that renders tools in a format neither parser reads."""
    template = chat_template or ""
    if "<tool_call>" in template or "tools" not in template:
        return "hermes"
    if "<|start_header_id|>" in template:
        return "llama3_json"
    return None
