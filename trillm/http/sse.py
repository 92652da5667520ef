"""Server-sent events: how every streaming endpoint sends its chunks, ends, and cleans up.

A route describes its chunks (`Chunks`); `stream_response` owns the rest, once:
the `data: [DONE]` line, the error event when the engine dies mid-stream (the
`openai` client raises on a `data: {"error": ...}` event), and the
`generation.close()` that aborts the request in the engine however the stream
ends. When the client goes away, Quart cancels the body (`trio.Cancelled` while
waiting for tokens, `GeneratorExit` while blocked on a slow reader); `finally`
covers both.

Responses carry `timeout = None`: Quart's RESPONSE_TIMEOUT (60 s by default)
would otherwise cut a long stream silently, without an error or `[DONE]`.
"""
from __future__ import annotations

import json
from typing import Protocol

from quart import Response

from trillm.engine.api import Delta, EngineUnavailableError
from trillm.http.errors import error_body
from trillm.http.generation import Generation

DONE = "data: [DONE]\n\n"


class Chunks(Protocol):
    def opening(self) -> list[dict]: ...

    def chunk(self, index: int, delta: Delta) -> dict | None: ...

    def closing(self) -> list[dict]: ...


class UsageChunks:
    """What the chat and completions streams share: every chunk opens with `chunk_head`, and the
    request's stream_options place the usage: on every chunk (continuous_usage_stats), or as null
    on each chunk and whole in a last chunk without choices (include_usage), or nowhere."""

    def __init__(self, generation: Generation, req, chunk_head: dict):
        self.generation = generation
        self.req = req
        self.chunk_head = chunk_head

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {**self.chunk_head, "choices": choices}
        if self.req.continuous_usage:
            chunk["usage"] = self.generation.usage()
        elif self.req.include_usage:
            chunk["usage"] = None
        return chunk

    def closing(self) -> list[dict]:
        if not self.req.include_usage:
            return []
        return [{**self.chunk_head, "choices": [], "usage": self.generation.usage()}]


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def stream_response(generation: Generation, chunks: Chunks) -> Response:
    async def events():
        try:
            for payload in chunks.opening():
                yield event(payload)
            async for index, delta in generation:
                payload = chunks.chunk(index, delta)
                if payload is not None:
                    yield event(payload)
            for payload in chunks.closing():
                yield event(payload)
        except EngineUnavailableError as exc:
            yield event(error_body(503, str(exc)))
        finally:
            generation.close()
        yield DONE

    response = Response(
        events(),
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    response.timeout = None
    return response
