"""Reasoning parsers: a reasoning model's `<think>...</think>` split off into `reasoning_content`.

Streaming-aware: text arrives a few tokens at a time, so a tail that may be the start of a
tag is held back until later text settles it (as stop strings are), and `finish()` releases
it. Two styles, chosen by `--reasoning-parser`:

  deepseek_r1  the chat template opens `<think>` itself, so the output starts inside the
               reasoning: everything up to `</think>` is reasoning (a `<think>` the model does
               write is dropped);
  qwen3        reasoning only when the output opens with `<think>`; otherwise (thinking
               disabled through `chat_template_kwargs.enable_thinking`) it is all content.
"""
from __future__ import annotations

from trillm.engine.api import held_prefix_len

START, END = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, implicit_start: bool):
        self._implicit_start = implicit_start
        self._state = "opening"  # -> "reasoning" -> "after_end" -> "content", or straight to "content"
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` makes safe to emit."""
        self._buffer += text
        reasoning = ""
        if self._state == "opening":
            head = self._buffer.lstrip()
            if head.startswith(START):
                self._buffer, self._state = head[len(START):], "reasoning"
            elif START.startswith(head):
                return "", ""  # the start tag may still be coming
            else:
                self._state = "reasoning" if self._implicit_start else "content"
        if self._state == "reasoning":
            at = self._buffer.find(END)
            if at == -1:
                keep = held_prefix_len(self._buffer, [END])
                reasoning, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                return reasoning, ""
            reasoning, self._buffer, self._state = self._buffer[:at], self._buffer[at + len(END):], "after_end"
        if self._state == "after_end":
            # The newlines a model puts after the end tag separate; they are not the answer.
            self._buffer = self._buffer.lstrip("\n")
            if not self._buffer:
                return reasoning, ""
            self._state = "content"
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the output."""
        rest, self._buffer = self._buffer, ""
        if self._state == "reasoning" or (self._state == "opening" and self._implicit_start):
            return rest, ""
        return "", rest


REASONING_PARSERS = {"deepseek_r1": True, "qwen3": False}  # name -> implicit_start


def reasoning_parser(name: str) -> ReasoningParser:
    return ReasoningParser(REASONING_PARSERS[name])
