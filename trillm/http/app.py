"""The Quart-Trio app: routes, error mapping, the engine task's lifetime.

`create_app()` with no arguments reads its settings from TRILLM_* variables, so
Hypercorn can build it itself:

    TRILLM_MODEL=/path/to/model hypercorn --worker-class trio 'trillm.http.app:create_app()'

(`trillm serve` adds what Hypercorn's own launch lacks: a drain on SIGTERM/SIGINT
that ends the streams it aborts with finish_reason "abort".)

The engine task lives in the app's nursery: started before serving, stopped after
(every live request aborted first). The model is loaded when the app is built, not
at startup, so Hypercorn's startup timeout never races a slow load.
"""
from __future__ import annotations

import logging

import trio
from quart import g, request
from quart_cors import cors
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from trillm.engine.api import EngineCore, EngineLink, EngineUnavailableError, QueueFullError, WeightsError
from trillm.heap import freeze_heap
from trillm.http import (
    adapters,
    anthropic_messages,
    chat_page,
    embeddings,
    http1_only,
    info,
    invocations,
    native,
    ollama,
    openai_chat,
    openai_completions,
    openapi,
    responses,
    weights,
)
from trillm.http.auth import AdminAccess, check_api_key
from trillm.http.connection import Connection
from trillm.http.errors import APIError, error_response
from trillm.http.logs import REQUEST_ID
from trillm.http.settings import ServerSettings, from_env
from trillm.http.state import EXTENSION, ServerState, check_media_type
from trillm.sampling_params import SamplingParamError

log = logging.getLogger(__name__)
# The response headers trillm sets that a browser page may read (left unset, quart-cors sends
# an empty Access-Control-Expose-Headers, which hides them).
EXPOSED_HEADERS = ["X-Request-Id", "Retry-After"]
RETRY_AFTER_S = 1  # what a 429 tells the client to wait before trying again


def create_app(settings: ServerSettings | None = None, core: EngineCore | EngineLink | None = None) -> QuartTrio:
    """`core`: an already loaded engine to serve (tests share one between apps, one app at a time)."""
    http1_only.install()  # before any connection: see trillm.http.http1_only
    settings = settings or from_env()
    owns_core = core is None  # a core the app made, it closes (its tensor-parallel ranks stop)
    core = core or EngineCore(settings.engine)
    app = QuartTrio("trillm")
    app.asgi_http_class = Connection  # see trillm.http.connection: every response ends its connection cleanly
    app.config["RESPONSE_TIMEOUT"] = None  # streams last as long as their requests; see trillm.http.sse
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes  # bounds what one request can make us buffer
    state = ServerState(settings, core)
    settings = state.settings
    app.extensions[EXTENSION] = state
    for module in (openai_chat, openai_completions, responses, anthropic_messages, embeddings, native, info,
                   invocations, openapi, adapters, weights, ollama):
        app.register_blueprint(module.blueprint)
    if settings.ui:
        app.register_blueprint(chat_page.blueprint)

    admin = AdminAccess(settings.host, settings.as_list(settings.allowed_hosts), settings.as_list(settings.admin_origins))

    @app.before_request
    async def authenticate_and_name():
        g.client_request_id = request.headers.get("X-Request-Id")
        REQUEST_ID.set(g.client_request_id or "-")  # a generating route names it (state.request_id)
        if settings.api_key is not None:
            refused = check_api_key(settings.api_key)
            if refused is not None:
                return refused
        else:
            admin.check()
        check_media_type()
        return None

    @app.after_request
    async def echo_request_id(response):
        echoed = g.get("client_request_id") or g.get("request_id")  # the client's own, else ours
        if echoed:
            response.headers["X-Request-Id"] = echoed
        log.info("%s %s -> %d", request.method, request.path, response.status_code)
        return response

    _register_error_handlers(app)
    _allow_cross_origin(app, settings)

    @app.before_serving
    async def start_engine():
        freeze_heap()  # what the app and its engine loaded stays out of the collector's walks (trillm.heap)
        await app.nursery.start(state.engine.run)

    @app.after_serving
    async def stop_engine():
        await state.engine.aclose()
        if state.request_templates is not None:
            state.request_templates.close()
        state.responses.close()
        if owns_core:
            await trio.to_thread.run_sync(core.close)

    return app


def _allow_cross_origin(app: QuartTrio, settings: ServerSettings) -> None:
    """CORS headers for browser front ends, by quart-cors: preflights (`OPTIONS`, which need no
    API key) get the Access-Control-Allow-* headers, and every response, errors included, the
    allowed origin. A wildcard origin is sent as `*`, as vLLM's server sends it; with credentials
    allowed the origin must be named (a browser refuses `*` with credentials)."""
    origins = settings.as_list(settings.allowed_origins)
    if settings.allow_credentials and "*" in origins:
        raise ValueError("--allow-credentials needs --allowed-origins to name the origins, not '*'.")
    cors(
        app,
        allow_origin=origins,
        allow_methods=settings.as_list(settings.allowed_methods),
        allow_headers=settings.as_list(settings.allowed_headers),
        allow_credentials=settings.allow_credentials,
        expose_headers=EXPOSED_HEADERS,
        send_origin_wildcard=True,
    )


def _register_error_handlers(app: QuartTrio) -> None:
    """Every failure becomes an OpenAI error body; only our own bugs are 500s."""

    @app.errorhandler(APIError)
    async def api_error(exc: APIError):
        return error_response(exc.status, exc.message, exc.param)

    @app.errorhandler(SamplingParamError)
    async def bad_parameter(exc: SamplingParamError):
        return error_response(exc.status, str(exc), exc.param)

    @app.errorhandler(WeightsError)
    async def weights_refused(exc: WeightsError):
        return error_response(400, str(exc))

    @app.errorhandler(QueueFullError)
    async def queue_full(exc: QueueFullError):
        response = error_response(429, str(exc))
        # Waiting requests leave as steps finish; a second is a few steps on any device, and
        # clients that honour the header (the openai SDKs) wait that long instead of guessing.
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.errorhandler(EngineUnavailableError)
    async def unavailable(exc: EngineUnavailableError):
        return error_response(503, str(exc))

    @app.errorhandler(RequestEntityTooLarge)
    async def too_large(exc: RequestEntityTooLarge):
        limit = app.config["MAX_CONTENT_LENGTH"]
        return error_response(413, f"The request body is larger than this server's limit of {limit} bytes.")

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException):
        return error_response(exc.code or 500, exc.description or exc.name)

    @app.errorhandler(Exception)
    async def internal_error(exc: Exception):
        log.exception("unhandled error", exc_info=exc)
        return error_response(500, f"Internal error: {type(exc).__name__}.")
