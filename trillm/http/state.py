"""What every route needs: the engine, the tokenizer, the settings, the metrics.

One ServerState per app, kept in `app.extensions`; routes reach it through
`current()`. Streaming bodies run after the request context is gone, so they get
what they need passed in, never through `current()`.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import replace
from collections.abc import Callable
from typing import TypeVar

import pydantic
import trio
from quart import current_app, g, request

from trillm.engine.api import AsyncEngine, EngineCore, EngineLink, LoRAError, ModelFacts, read_facts
from trillm.http import json_body, paths
from trillm.http.errors import APIError, from_validation_error
from trillm.http.logprobs import TokenTexts
from trillm.http.logs import REQUEST_ID
from trillm.http.metrics import Metrics
from trillm.http.prompts import PromptBound
from trillm.http.request_templates import RequestTemplates
from trillm.http.responses_store import ResponseStore, SharedResponseStore
from trillm.http.settings import ServerSettings
from trillm.http.settings_check import check_settings
from trillm.http.tool_parsers import default_parser

EXTENSION = "trillm"
# Bodies larger than this are decoded and validated in a worker thread: their cost grows with
# them, and on the event loop it would delay every other request's next token.
OFF_LOOP_BYTES = 16 << 10
PREPARE_THREADS = 2  # requests tokenised, rendered or validated at once, beside the engine's step
T = TypeVar("T")


class ServerState:
    def __init__(self, settings: ServerSettings, core: EngineCore | EngineLink):
        self.engine = engine = AsyncEngine(core, settings.max_waiting)  # the app's only way to the core
        settings = self.settings = replace(settings, engine=engine.args)  # what runs, for /server_info
        check_settings(settings)
        self.tokenizer = engine.tokenizer
        # The tool-call parser for tool_choice auto; None ("none", or no parser fits the template) refuses auto.
        if settings.tool_call_parser is None:
            self.tool_call_parser = default_parser(self.chat_template)
        else:
            self.tool_call_parser = None if settings.tool_call_parser == "none" else settings.tool_call_parser
        self.token_texts = TokenTexts(engine.tokenizer)
        self.vocab_size = engine.config.hf_config.vocab_size
        self.max_model_len = engine.config.max_model_len
        self.prompt_bound = PromptBound.of(engine.tokenizer, self.max_model_len)  # texts too long refused untokenized
        # Templates requests bring render out of the server, bounded (closed when the app stops).
        self.request_templates = (RequestTemplates(engine.tokenizer) if settings.trust_request_chat_template
                                  and engine.tokenizer is not None else None)
        self.model_name = settings.served_model_name or engine.config.name
        args = engine.args
        self.metrics = Metrics(self.model_name, engine.stats, settings.metrics_prefix,
                               args.max_loras if engine.lora_enabled else None,
                               {"block_size": str(args.block_size), "cache_dtype": args.kv_cache_dtype.value,
                                "enable_prefix_caching": str(args.enable_prefix_caching)})
        if engine.shared:  # several fronts: any of them may be asked for any stored response
            self.responses = SharedResponseStore(os.path.join(core.directory, "responses.sqlite"),
                                                 settings.responses_store_size, self.off_loop)
        else:
            self.responses = ResponseStore(settings.responses_store_size)
        # A limiter of its own, so a flood of large requests waits here and never takes the
        # threads the engine's step and grammar compiles run on.
        self.prepare_limiter = trio.CapacityLimiter(PREPARE_THREADS)
        self._facts: ModelFacts | None = None

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` in a worker thread (at most PREPARE_THREADS at once): for work that grows
        with a request (decoding, validation, tokenising, templates, bad-words preparation).
        `fn` must touch nothing the event loop owns (no Quart context, no engine state). If the
        caller is cancelled (its client went away), it returns at once and the thread finishes
        alone, still holding its limiter token, so abandoned work still counts against the bound."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.prepare_limiter, abandon_on_cancel=True)

    @property
    def weights_path(self) -> str:
        """Where the served weights came from (a path, or the default model's name)."""
        return self.engine.args.model or self.engine.config.name

    async def model_facts(self) -> ModelFacts:
        """What the served file says about the model (trillm.model.facts), read once, off the loop."""
        if self._facts is None:
            self._facts = await self.off_loop(read_facts, self.engine.args.model, self.engine.config.hf_config,
                                              self.max_model_len)
        return self._facts

    @property
    def chat_template(self) -> str | None:
        """The model's chat template (None without a tokenizer)."""
        return getattr(self.tokenizer, "chat_template", None)

    def check_model(self, model: str | None, field: str = "model") -> str | None:
        """OpenAI clients must name a model: ours, or one of its LoRA adapters, whose name this
        returns (None: the base model); any other name is a 404 naming `field`, as with vLLM."""
        if model is None or model == self.model_name:
            return None
        if model not in self.engine.adapters:
            raise APIError(404, f"The model `{model}` does not exist.", field)
        return model

    async def requested_lora(self, model: str | None, lora_request=None, field: str = "model") -> str | None:
        """The LoRA adapter a request runs under: TensorRT-LLM's `lora_request` (loading it from
        its lora_path first when it is not loaded, if --allow-runtime-lora and the path lies inside
        --allowed-weights-dir: 403s otherwise), else the adapter `model` names (None: the base
        model). An unknown adapter is a 404 naming `field`."""
        if lora_request is not None:
            model, field = lora_request.lora_name, "lora_request"
            adapters = self.engine.adapters
            if lora_request.lora_path and self.engine.lora_enabled and model not in adapters:
                paths.require(self.settings.allow_runtime_lora, "--allow-runtime-lora",
                              "Loading a LoRA adapter from lora_request.lora_path")
                path = paths.allowed_path(self.settings, lora_request.lora_path, "lora_request.lora_path")
                try:
                    await self.engine.weights.load_lora(model, path, limit=self.settings.max_lora_adapters)
                except LoRAError as exc:
                    if model not in adapters:  # not a concurrent load of the same adapter
                        raise APIError(exc.status, str(exc), "lora_request") from None
        return self.check_model(model, field)


def current() -> ServerState:
    return current_app.extensions[EXTENSION]


async def parse_body(model: type[pydantic.BaseModel], status: int = 400):
    """The JSON body as `model`; 400 (or `status`, for schema errors) naming the bad field."""
    return await validate(model, await read_json(), status)


async def model_request(model: type[pydantic.BaseModel]) -> tuple[ServerState, pydantic.BaseModel]:
    """The server and the JSON body as `model` (400 naming a bad field), whose `model` field
    names the served model (404 otherwise): the opening of every OpenAI-style route."""
    state = current()
    req = await parse_body(model)
    state.check_model(req.model)
    return state, req


async def validate(model: type[pydantic.BaseModel], body, status: int = 400):
    """`body` (this request's decoded JSON, or part of it) as `model`; `status` naming the bad
    field if it does not fit. Off the event loop for a large body."""
    if len(await request.get_data()) > OFF_LOOP_BYTES:
        return await current().off_loop(validated, model, body, status)
    return validated(model, body, status)


def validated(model: type[pydantic.BaseModel], body, status: int = 400):
    """`validate`'s work, for any thread."""
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc, status) from None


async def read_json():
    """The request's body, decoded (once per request: /invocations reads it, then its route); 400
    if it is not UTF-8 JSON, has a key twice in one object or nests too deep (json_body). An
    empty body is `{}`. The media type was checked before the route (`check_media_type`)."""
    if "json_body" not in g:
        data = await request.get_data()
        if len(data) > OFF_LOOP_BYTES:
            g.json_body = await current().off_loop(_decode, data)
        else:
            g.json_body = _decode(data)
    return g.json_body


def _decode(data: bytes):
    try:
        text = data.decode("utf-8")  # JSON on the wire is UTF-8 (RFC 8259); json.loads would guess
    except UnicodeDecodeError as exc:
        raise APIError(400, f"The body is not valid UTF-8: {exc}") from None
    try:
        return json_body.loads(text or "{}")
    except json_body.JSONError as exc:
        raise APIError(400, f"The body cannot be read: {exc}") from None


def check_media_type() -> None:
    """A request that carries a body, or names its media type, must say JSON: a 415 otherwise.
    Browsers send a cross-site POST of text/plain, form data or multipart without asking the
    server first (no CORS preflight), so a route that read any body would run such a request
    for any web page its user visits."""
    if request.method in ("GET", "HEAD", "OPTIONS", "DELETE"):
        return
    content_type = request.headers.get("Content-Type")
    has_body = request.content_length not in (None, 0) or "chunked" in request.headers.get("Transfer-Encoding", "")
    if (content_type is not None or has_body) and not json_body.media_type_is_json(content_type):
        named = f"{content_type!r}" if content_type else "none"
        raise APIError(415, f"Unsupported media type {named}: send the body as JSON, with "
                            "'Content-Type: application/json'.")


def request_id(prefix: str, rid: str | None = None, separator: str = "-") -> tuple[str, str | None]:
    """A fresh `{prefix}-<hex>`, the server's id for this request (the engine's key and the
    response's `id`), and the client's own id for it, if any: the native body's `rid`, else the
    X-Request-Id header. A client's id is never trusted as a key: two live requests may carry
    the same one (a proxy's retry); it names the request in logs and in `/abort_request`, and
    the response's X-Request-Id header echoes the header's. (`separator`: "_" for OpenAI's
    Responses ids, `resp_<hex>`.)"""
    server_id = f"{prefix}{separator}{uuid.uuid4().hex}"
    client_id = rid or g.get("client_request_id")
    g.request_id = server_id
    REQUEST_ID.set(client_id or server_id)
    return server_id, client_id
