"""OpenAI's Responses API: POST /v1/responses (whole, streamed as typed events, or in the
background), GET and DELETE /v1/responses/{id}, GET .../input_items, POST .../cancel.

A response is a chat generation underneath (trillm.http.protocol.responses turns the request
into a ChatCompletionRequest): the same template, tools, grammars, reasoning parser, admission,
metrics and abort. Its engine group's id is the response's id, so `/abort_request` takes it;
a disconnect, a cancel, `/abort_request` or a drain ends it as it ends a chat stream, and its
blocks are free before the next step. `ResponseBuilder` turns the choice's text (split by
ChatOutput into reasoning, content and calls) into output items and the stream's events; a
whole answer is built by the same code, its events dropped.
"""
from __future__ import annotations

import copy
import enum
import json
import time

import trio
from quart import Blueprint, Response, current_app, request

from trillm.engine.api import EngineUnavailableError, FinishReason
from trillm.http.chat_output import ChatDelta, chat_output
from trillm.http.errors import APIError
from trillm.http.generation import Generation, in_client_terms
from trillm.http.prompts import NO_BOUND, chat_prompt
from trillm.http.protocol.chat import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCallMessage
from trillm.http.protocol.responses import FIELD_NAMES, ResponsesRequest, item_id, items_to_messages, with_ids
from trillm.http.responses_store import StoredResponse
from trillm.http.state import ServerState, current, model_request, request_id
from trillm.http.tools import tool_choice
from trillm.sampling_params import SamplingParamError


class ResponseStatus(enum.StrEnum):
    """A response's `status`, and its output items' (in_progress, completed, incomplete), as
    OpenAI's Responses API names them; a member is also that string, so it goes on the wire as is."""

    QUEUED = "queued"  # a background response not yet running
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"  # cut short by max_output_tokens
    CANCELLED = "cancelled"  # aborted, cancelled, or its client left
    FAILED = "failed"  # the engine failed under it

blueprint = Blueprint("responses", __name__)


@blueprint.post("/v1/responses")
async def create_response():
    state, req = await model_request(ResponsesRequest)
    if req.background and not req.store:
        raise SamplingParamError("background", "background needs store: true (a background response is fetched by id).")
    if req.background and req.stream:
        raise SamplingParamError("stream", "A background response is not streamed; fetch it by id.")
    earlier: list[ChatMessage] = []
    if req.previous_response_id is not None:
        previous = await state.responses.get(req.previous_response_id, "previous_response_id")
        if previous.running:
            raise SamplingParamError("previous_response_id", f"Response {req.previous_response_id!r} is still running.")
        earlier = previous.conversation
    with in_client_terms(FIELD_NAMES):
        chat, params, choice, prompt = await state.off_loop(_prepare, state, req, earlier)
    response_id, client_id = request_id("resp", separator="_")
    generation = Generation(state, response_id, client_id, [prompt], params, field_names=FIELD_NAMES,
                            lora_name=await state.requested_lora(req.model))
    builder = ResponseBuilder(state, req, response_id, chat, choice, params)
    conversation = earlier + items_to_messages(req.items())
    stored = StoredResponse(builder.response(ResponseStatus.QUEUED if req.background else ResponseStatus.IN_PROGRESS),
                            with_ids(req.items()), conversation)
    await generation.start()
    if req.background:
        await state.responses.put(stored)
        current_app.nursery.start_soon(_run, state, generation, builder, stored)
        return stored.response
    if req.stream:
        response = Response(_events(state, generation, builder, stored), content_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        response.timeout = None  # as chat streams: a response lasts as long as its generation
        return response
    await _run(state, generation, builder, stored)
    return stored.response


def _prepare(state: ServerState, req: ResponsesRequest, earlier: list[ChatMessage]) -> tuple:
    """The request as chat, its sampling params, tool choice and prompt (off the event loop: the
    work grows with the input items)."""
    chat = req.to_chat(earlier, stream=req.stream)
    params = chat.to_sampling_params(state.vocab_size, state.tokenizer)
    choice, params = tool_choice(chat, state.tool_call_parser, params)
    return chat, params, choice, _prompt(state, req, chat, choice, params.max_tokens)


def _prompt(state: ServerState, req: ResponsesRequest, chat: ChatCompletionRequest, choice, max_tokens) -> list[int]:
    """The prompt's token ids. With truncation "auto", the oldest turns (never the system
    message, never the last turn) are dropped until the prompt and max_output_tokens fit."""
    tools = chat.tools if choice != "none" else None
    messages = list(chat.messages)
    options = chat.template_options(state.chat_template, trust_request_template=False)
    limit = state.max_model_len - (max_tokens or 1)
    while True:
        ids = chat_prompt(state.tokenizer, messages, options, tools=tools,
                          bound=state.prompt_bound if req.truncation != "auto" else NO_BOUND)
        droppable = [i for i, m in enumerate(messages[:-1]) if m.role not in ("system", "developer")]
        if req.truncation != "auto" or len(ids) <= limit or not droppable:
            return ids
        del messages[droppable[0]]


async def _run(state: ServerState, generation: Generation, builder: ResponseBuilder, stored: StoredResponse) -> None:
    """Run a response to its end, keeping its stored record current. Owns `generation`: closes it."""
    try:
        async for _, delta in generation:
            builder.feed(delta)
            stored.response = builder.response(ResponseStatus.IN_PROGRESS)
    except EngineUnavailableError as exc:
        builder.fail(str(exc))
    finally:
        generation.close()
        await _finish(state, generation, builder, stored)


async def _finish(state: ServerState, generation: Generation, builder: ResponseBuilder, stored: StoredResponse) -> None:
    """Seal the response (an unfinished one was cancelled: the client left, or it was aborted) and
    store it: a background one only if it is still stored (a DELETE meanwhile stays a delete).
    Shielded: it runs after its client left, too."""
    builder.end(generation)
    stored.response = builder.response()
    stored.conversation = stored.conversation + builder.answer_messages()
    stored.done.set()
    with trio.CancelScope(shield=True):
        if builder.req.background:
            await state.responses.update(stored)
        elif builder.req.store:
            await state.responses.put(stored)


async def _events(state: ServerState, generation: Generation, builder: ResponseBuilder, stored: StoredResponse):
    """The typed server-sent events: `event: <type>` and its JSON, each with a sequence_number."""
    try:
        yield builder.event("response.created", response=builder.response(ResponseStatus.IN_PROGRESS))
        yield builder.event("response.in_progress", response=builder.response(ResponseStatus.IN_PROGRESS))
        try:
            async for _, delta in generation:
                for event in builder.feed(delta):
                    yield event
        except EngineUnavailableError as exc:
            builder.fail(str(exc))
        generation.close()
        for event in builder.end(generation):
            yield event
        terminal = {ResponseStatus.COMPLETED: "response.completed",
                    ResponseStatus.FAILED: "response.failed"}.get(builder.status, "response.incomplete")
        yield builder.event(terminal, response=builder.response())
    finally:
        generation.close()
        if not stored.done.is_set():
            await _finish(state, generation, builder, stored)


class ResponseBuilder:
    """One response's output items, status and usage, built from its choice's deltas; each step
    also returns the stream events it makes (a whole response ignores them)."""

    def __init__(self, state: ServerState, req: ResponsesRequest, response_id: str, chat: ChatCompletionRequest,
                 choice, params):
        self.state = state
        self.req = req
        self.id = response_id
        self.params = params
        self.created_at = int(time.time())
        self.chat_output = chat_output(state.settings.reasoning_parser, state.tool_call_parser, choice,
                                       chat.parallel_tool_calls)
        self.output: list[dict] = []
        self.status = ResponseStatus.IN_PROGRESS
        self.error: dict | None = None
        self.incomplete_details: dict | None = None
        self.usage: dict | None = None
        self._sequence = 0
        self._reasoning: dict | None = None  # the open reasoning item
        self._message: dict | None = None  # the open message item
        self._held_whitespace = ""  # content before a message opens: around tool calls, none
        self._calls: dict[int, dict] = {}  # tool call index -> its function_call item
        self._ended = False

    # --- the response object -----------------------------------------------------------------

    def response(self, status: ResponseStatus | None = None) -> dict:
        req = self.req
        fmt = req.text.format.model_dump(exclude_none=True, by_alias=True) if req.text and req.text.format else None
        tool_choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status or self.status,
            "background": req.background,
            "error": self.error,
            "incomplete_details": self.incomplete_details,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "metadata": req.metadata or {},
            "model": req.model or self.state.model_name,
            "output": copy.deepcopy(self.output),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning else None,
            "service_tier": "default",
            "store": req.store,
            "temperature": self.params.temperature,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": tool_choice or "auto",  # OpenAI reports auto when tools were not named
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": self.params.top_p,
            "truncation": req.truncation,
            "usage": self.usage,
            "user": req.user,
        }

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    # --- building ------------------------------------------------------------------------------

    def feed(self, delta) -> list[str]:
        parts = self.chat_output.feed(delta.text)
        if delta.finished:
            parts = parts + self.chat_output.finish()
        return self._take(parts)

    def fail(self, message: str) -> None:
        self.status = ResponseStatus.FAILED
        self.error = {"code": "server_error", "message": message}

    def end(self, generation: Generation) -> list[str]:
        """Close every open item and settle status and usage; once (later calls return nothing)."""
        if self._ended:
            return []
        self._ended = True
        completion = generation.choices[0].completion
        reason = completion.finish_reason
        if self.status != ResponseStatus.FAILED:
            if reason is None or reason == FinishReason.ABORT:
                self.status = ResponseStatus.CANCELLED
            elif reason == FinishReason.LENGTH:
                self.status = ResponseStatus.INCOMPLETE
                self.incomplete_details = {"reason": "max_output_tokens"}
            else:
                self.status = ResponseStatus.COMPLETED
        events = self._close_reasoning()
        if self._message is None and self._held_whitespace and not self._calls:
            events += self._open_message(self._held_whitespace)
        item_status = ResponseStatus.COMPLETED if self.status == ResponseStatus.COMPLETED else ResponseStatus.INCOMPLETE
        if self._message is not None:
            item, index = self._message, self._index(self._message)
            part = item["content"][0]
            events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"], logprobs=[]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
            item["status"] = item_status
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        for item in self._calls.values():
            index = self._index(item)
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
            item["status"] = item_status
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        usage = generation.usage()
        reasoning = self.chat_output.reasoning
        reasoning_tokens = len(self.state.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        self.usage = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage["total_tokens"],
        }
        return events

    def answer_messages(self) -> list[ChatMessage]:
        """The answer as chat turns, for a later previous_response_id (reasoning dropped)."""
        content = self._message["content"][0]["text"] if self._message is not None else None
        calls = [ToolCallMessage(id=c["call_id"], function=FunctionCall(name=c["name"], arguments=c["arguments"]))
                 for c in self._calls.values()]
        if content is None and not calls:
            return []
        return [ChatMessage(role="assistant", content=content, tool_calls=calls or None)]

    def _index(self, item: dict) -> int:
        return next(i for i, x in enumerate(self.output) if x is item)

    def _add(self, item: dict) -> list[str]:
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=copy.deepcopy(item))]

    def _take(self, parts: ChatDelta) -> list[str]:
        events = []
        if parts.reasoning:
            if self._reasoning is None:
                self._reasoning = {"type": "reasoning", "id": item_id("rs"), "summary": [],
                                   "content": [{"type": "reasoning_text", "text": ""}], "status": ResponseStatus.IN_PROGRESS}
                events += self._add(self._reasoning)
            self._reasoning["content"][0]["text"] += parts.reasoning
            events.append(self.event("response.reasoning_text.delta", item_id=self._reasoning["id"],
                                     output_index=self._index(self._reasoning), content_index=0, delta=parts.reasoning))
        if parts.content:
            events += self._close_reasoning()
            if self._message is None and not (self._held_whitespace + parts.content).strip():
                self._held_whitespace += parts.content
            elif self._message is None:
                events += self._open_message(self._held_whitespace + parts.content)
            else:
                events += self._text(parts.content)
        for call in parts.tool_calls:
            events += self._close_reasoning()
            if "id" in call:
                item = {"type": "function_call", "id": item_id("fc"), "call_id": call["id"],
                        "name": call["function"]["name"], "arguments": "", "status": ResponseStatus.IN_PROGRESS}
                self._calls[call["index"]] = item
                events += self._add(item)
            item = self._calls[call["index"]]
            if call["function"]["arguments"]:
                item["arguments"] += call["function"]["arguments"]
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=self._index(item), delta=call["function"]["arguments"]))
        return events

    def _open_message(self, text: str) -> list[str]:
        self._held_whitespace = ""
        self._message = {"type": "message", "id": item_id("msg"), "role": "assistant", "status": ResponseStatus.IN_PROGRESS,
                         "content": []}
        events = self._add(self._message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._message["content"].append(part)
        events.append(self.event("response.content_part.added", item_id=self._message["id"],
                                 output_index=self._index(self._message), content_index=0, part=dict(part)))
        return events + self._text(text)

    def _text(self, text: str) -> list[str]:
        self._message["content"][0]["text"] += text
        return [self.event("response.output_text.delta", item_id=self._message["id"],
                           output_index=self._index(self._message), content_index=0, delta=text, logprobs=[])]

    def _close_reasoning(self) -> list[str]:
        item, self._reasoning = self._reasoning, None
        if item is None:
            return []
        index = self._index(item)
        item["status"] = ResponseStatus.COMPLETED
        return [
            self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                       text=item["content"][0]["text"]),
            self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item)),
        ]


@blueprint.get("/v1/responses/<response_id>")
async def get_response(response_id: str):
    return (await current().responses.get(response_id)).response


@blueprint.delete("/v1/responses/<response_id>")
async def delete_response(response_id: str):
    state = current()
    stored = await state.responses.delete(response_id)
    if stored.running:
        await state.engine.abort_everywhere(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@blueprint.get("/v1/responses/<response_id>/input_items")
async def input_items(response_id: str):
    """The response's input items, newest first unless `order=asc`, `limit` (1-100, default 20)
    after the item id `after`, OpenAI's cursor paging."""
    items = list((await current().responses.get(response_id)).input_items)
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, "order must be asc or desc.", "order")
    if order == "desc":
        items.reverse()
    try:
        limit = int(request.args.get("limit", 20))
    except ValueError:
        raise APIError(400, "limit must be an integer.", "limit") from None
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be in [1, 100].", "limit")
    after = request.args.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"No input item of this response has id {after!r}.", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


@blueprint.post("/v1/responses/<response_id>/cancel")
async def cancel_response(response_id: str):
    """Cancel a background response: aborted before the next step; answers once it has ended."""
    state = current()
    stored = await state.responses.get(response_id)
    if not stored.response["background"]:
        raise APIError(400, "Only a background response can be cancelled.", "response_id")
    if stored.running:
        await state.engine.abort_everywhere(response_id)
        stored = await state.responses.ended(stored)
    elif stored.response["status"] != ResponseStatus.CANCELLED:
        raise APIError(400, f"Response {response_id!r} has already ended ({stored.response['status']}).", "response_id")
    return stored.response
