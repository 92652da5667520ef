"""Anthropic's Messages API: POST /v1/messages (whole, or streamed as Anthropic's typed events)
and POST /v1/messages/count_tokens, so Claude-style clients and coding agents run unmodified.

A message is a chat generation underneath (trillm.http.protocol.anthropic turns the request into
a ChatCompletionRequest): the same template, tools, grammars, reasoning parser, admission, LoRA
adapters by `model`, prefix cache, metrics and abort. Its engine group's id is the message's id
(`msg_...`), so `/abort_request` takes it; a disconnect or a drain ends it as it ends a chat
stream, and its blocks are free before the next step. `MessageBuilder` turns the choice's text
(split by ChatOutput into reasoning, content and calls) into content blocks and the stream's
events; a whole message is built by the same code, its events dropped. Errors on these routes
are Anthropic's shape (trillm.http.errors), so the SDKs raise their own exception classes.
"""
from __future__ import annotations

import base64
import copy
import hashlib
import json
import logging

import trio
from quart import Blueprint, Response

from trillm.engine.api import EngineUnavailableError, FinishReason
from trillm.http.chat_output import ChatDelta, chat_output
from trillm.http.errors import anthropic_error_body
from trillm.http.generation import Generation, capped, in_client_terms
from trillm.http.logs import clipped
from trillm.http.prompts import chat_prompt
from trillm.http.protocol.anthropic import FIELD_NAMES, CountTokensRequest, MessagesRequest, tool_use_id
from trillm.http.protocol.chat import ChatCompletionRequest
from trillm.http.state import ServerState, model_request, request_id
from trillm.http.tools import tool_choice

log = logging.getLogger(__name__)
blueprint = Blueprint("anthropic_messages", __name__)
PING_INTERVAL_S = 10.0  # a `ping` event after this long without another, as Anthropic's streams keep alive


@blueprint.post("/v1/messages")
async def create_message():
    state, req = await model_request(MessagesRequest)
    with in_client_terms(FIELD_NAMES):
        chat, params, choice, prompt = await state.off_loop(_prepare, state, req)
    msg_id, client_id = request_id("msg", separator="_")
    generation = Generation(state, msg_id, client_id, [prompt], params, field_names=FIELD_NAMES,
                            lora_name=await state.requested_lora(req.model))
    if req.metadata is not None and req.metadata.user_id is not None:
        log.info("%s user=%s", msg_id, clipped(req.metadata.user_id))
    builder = MessageBuilder(state, req, msg_id, chat, choice, len(prompt))
    await generation.start()
    headers = {"request-id": msg_id}  # where Anthropic's SDKs read a response's id (`_request_id`)
    if req.stream:
        response = Response(_events(generation, builder), content_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        response.timeout = None  # as chat streams: a message lasts as long as its generation
        return response
    await generation.run(builder.feed)
    builder.end(generation)
    return builder.message(), 200, headers


@blueprint.post("/v1/messages/count_tokens")
async def count_tokens():
    """The prompt's length as the template renders system, tools and messages for /v1/messages."""
    state, req = await model_request(CountTokensRequest)
    with in_client_terms(FIELD_NAMES):
        prompt = await state.off_loop(_count, state, req)
    return {"input_tokens": len(prompt)}


def _prepare(state: ServerState, req: MessagesRequest) -> tuple:
    """The request as chat, its sampling params, tool choice and prompt (off the event loop: the
    work grows with the messages)."""
    chat = req.chat()
    params = chat.to_sampling_params(state.vocab_size, state.tokenizer)
    choice, params = tool_choice(chat, state.tool_call_parser, params)
    prompt = _prompt(state, chat, choice)
    # max_tokens is a cap, never a demand: coding agents ask 32000 of any model (Claude Code's
    # default), and a model of a smaller context serves what fits after the prompt, its
    # stop_reason "max_tokens" where the context ran out (a prompt that fills it is still refused)
    room = state.max_model_len - len(prompt)
    if room > 0:
        params = capped(params, room)
    return chat, params, choice, prompt


def _count(state: ServerState, req: CountTokensRequest) -> list[int]:
    chat = req.to_chat()
    return _prompt(state, chat, chat.tool_choice or ("auto" if chat.tools else "none"))


def _prompt(state: ServerState, chat: ChatCompletionRequest, choice) -> list[int]:
    options = chat.template_options(state.chat_template, trust_request_template=False)
    return chat_prompt(state.tokenizer, chat.messages, options, tools=chat.tools if choice != "none" else None,
                       bound=state.prompt_bound)


async def _events(generation: Generation, builder: MessageBuilder):
    """Anthropic's server-sent events: message_start, each block's start, deltas and stop,
    message_delta, message_stop; a ping at the start and whenever PING_INTERVAL_S passes without
    an event; an `error` event if the engine fails mid-stream."""
    try:
        yield builder.event("message_start", message=builder.message())
        yield builder.event("ping")
        deltas = generation.__aiter__()
        while True:
            try:
                with trio.move_on_after(PING_INTERVAL_S) as waited:
                    _, delta = await deltas.__anext__()
            except StopAsyncIteration:
                break
            except EngineUnavailableError as exc:
                yield builder.event("error", error=anthropic_error_body(503, str(exc))["error"])
                return
            if waited.cancelled_caught:
                yield builder.event("ping")
                continue
            for event in builder.feed(delta):
                yield event
        generation.close()
        for event in builder.end(generation):
            yield event
        message = builder.message()
        yield builder.event("message_delta", delta={"stop_reason": message["stop_reason"],
                                                    "stop_sequence": message["stop_sequence"]},
                            usage=message["usage"])
        yield builder.event("message_stop")
    finally:
        generation.close()


def _signature(thinking: str) -> str:
    """A thinking block's `signature`: Anthropic's is opaque and checked by its own servers only;
    this one names the text it came with, so a client sending the block back changes nothing."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


class MessageBuilder:
    """One message's content blocks, stop reason and usage, built from its choice's deltas;
    each step also returns the stream events it makes (a whole message ignores them)."""

    def __init__(self, state: ServerState, req: MessagesRequest, msg_id: str, chat: ChatCompletionRequest, choice,
                 prompt_tokens: int):
        """`prompt_tokens`: the prompt's length, which message_start already reports (how much of
        it the prefix cache held comes with the end)."""
        self.state = state
        self.req = req
        self.id = msg_id
        self.output = chat_output(state.settings.reasoning_parser, state.tool_call_parser, choice,
                                  chat.parallel_tool_calls)
        self.content: list[dict] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage = {"input_tokens": prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                      "output_tokens": 0}
        self._open: dict | None = None  # the block being streamed
        self._held_whitespace = ""  # content before a text block opens: around tool calls, none
        self._calls: dict[int, dict] = {}  # chat's tool call index -> its tool_use block
        self._arguments: dict[int, str] = {}  # ... and the JSON of its input so far
        self._ended = False

    def message(self) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.req.model,
            "content": copy.deepcopy(self.content),  # the stream goes on changing the blocks
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": dict(self.usage),
        }

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, **fields}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def feed(self, delta) -> list[str]:
        parts = self.output.feed(delta.text)
        if delta.finished:
            parts = parts + self.output.finish()
        return self._take(parts)

    def end(self, generation: Generation) -> list[str]:
        """Close the open block; settle stop reason and usage. Once (later calls return nothing)."""
        if self._ended:
            return []
        self._ended = True
        events = []
        if not self.content and self._held_whitespace:
            events += self._start({"type": "text", "text": ""}) + self._text(self._held_whitespace)
        events += self._close()
        for index, block in self._calls.items():
            try:
                block["input"] = json.loads(self._arguments[index] or "{}")
            except ValueError:  # cut short by max_tokens (what arrived stays in the stream's deltas), or an
                block["input"] = {}  # integer longer than Python converts
        completion = generation.choices[0].completion
        reason = completion.finish_reason
        if reason == FinishReason.LENGTH:
            self.stop_reason = "max_tokens"
        elif reason == FinishReason.STOP and self._calls:
            self.stop_reason = "tool_use"
        elif reason == FinishReason.STOP and isinstance(completion.stop_reason, str):
            self.stop_reason, self.stop_sequence = "stop_sequence", completion.stop_reason
        elif reason == FinishReason.STOP:
            self.stop_reason = "end_turn"
        elif reason == FinishReason.ABORT:  # /abort_request, a drain: Anthropic's paused turn, which a
            self.stop_reason = "pause_turn"  # client resends as it is to go on
        usage = generation.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        self.usage = {"input_tokens": usage["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": cached, "output_tokens": usage["completion_tokens"]}
        return events

    def _take(self, parts: ChatDelta) -> list[str]:
        events = []
        if parts.reasoning:
            if self._open is None or self._open["type"] != "thinking":
                events += self._close() + self._start({"type": "thinking", "thinking": "", "signature": ""})
            self._open["thinking"] += parts.reasoning
            events.append(self._delta({"type": "thinking_delta", "thinking": parts.reasoning}))
        if parts.content:
            if self._open is not None and self._open["type"] == "text":
                events += self._text(parts.content)
            elif not (self._held_whitespace + parts.content).strip():
                self._held_whitespace += parts.content
            else:
                text, self._held_whitespace = self._held_whitespace + parts.content, ""
                events += self._close() + self._start({"type": "text", "text": ""}) + self._text(text)
        for call in parts.tool_calls:
            index = call["index"]
            if "id" in call:
                events += self._close()
                self._held_whitespace = ""
                self._calls[index] = {"type": "tool_use", "id": tool_use_id(), "name": call["function"]["name"],
                                      "input": {}}
                self._arguments[index] = ""
                events += self._start(self._calls[index])
            arguments = call["function"]["arguments"]
            if arguments:
                self._arguments[index] += arguments
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments},
                                          self._index(self._calls[index])))
        return events

    def _index(self, block: dict) -> int:
        return next(i for i, b in enumerate(self.content) if b is block)

    def _start(self, block: dict) -> list[str]:
        self.content.append(block)
        self._open = block
        return [self.event("content_block_start", index=len(self.content) - 1, content_block=dict(block))]

    def _delta(self, delta: dict, index: int | None = None) -> str:
        return self.event("content_block_delta", index=len(self.content) - 1 if index is None else index, delta=delta)

    def _text(self, text: str) -> list[str]:
        self._open["text"] += text
        return [self._delta({"type": "text_delta", "text": text})]

    def _close(self) -> list[str]:
        block, self._open = self._open, None
        if block is None:
            return []
        events = []
        if block["type"] == "thinking":
            block["signature"] = _signature(block["thinking"])
            events.append(self._delta({"type": "signature_delta", "signature": block["signature"]},
                                      self._index(block)))
        return events + [self.event("content_block_stop", index=self._index(block))]
