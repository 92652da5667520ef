"""Errors in OpenAI's wire format, and the mapping from what can go wrong to a status.

Every error the server sends, whatever its cause, has the body
`{"error": {"message", "type", "param", "code"}}` with `code` the HTTP status (as
vLLM does), so a client needs one parser. A client's mistake is never a 500.

Why 429 and not 503 when the waiting queue is full: the server is healthy and the
condition is transient and load-dependent, so the client should back off and retry
(the `openai` client does so on its own). 503 means the server cannot serve at all
(its engine died, or it is shutting down); /health answers 503 at the same time,
so a load balancer can tell overload from failure.

Anthropic's Messages routes (/v1/messages and what lies under it) answer in Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`, with its type names, and 529
`overloaded_error` where other routes say 503: its SDKs pick their exception class from these.
Ollama's routes (/api/...) answer `{"error": "..."}`, its one shape, with the same statuses.
`error_response` chooses by the request's path, so every handler and the key check speak the
right one without knowing which API they serve.
"""
from __future__ import annotations

import json
import re

import pydantic
from quart import Response, has_request_context, request

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"
OLLAMA_PREFIX = "/api/"


class APIError(Exception):
    """Raise from a route to answer with an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    error_type = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def anthropic_status(status: int) -> int:
    """The status Anthropic's API uses for what trillm answers with `status` (a 503 is its 529)."""
    return 529 if status == 503 else status


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error body for what trillm answers with `status`."""
    status = anthropic_status(status)
    error_type = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def speaks_anthropic() -> bool:
    """Whether the request being answered is one of Anthropic's Messages routes."""
    return has_request_context() and (request.path == ANTHROPIC_PATH or request.path.startswith(ANTHROPIC_PATH + "/"))


def error_response(status: int, message: str, param: str | None = None) -> Response:
    """The error in the shape of the API the request called (OpenAI's, or Anthropic's or Ollama's
    on their routes)."""
    if speaks_anthropic():
        body, status = anthropic_error_body(status, message), anthropic_status(status)
    elif has_request_context() and request.path.startswith(OLLAMA_PREFIX):
        # Ollama's shape has no `param`: the message names the field
        body = {"error": message if param is None or param in message else f"{param}: {message}"}
    else:
        body = error_body(status, message, param)
    return Response(json.dumps(body), status=status, content_type="application/json")


# pydantic names the member of a union it tried in the error's location (`stop.list[str]`,
# `sampling_params.NativeSamplingParams.temperature`); the client named only the fields.
_UNION_MEMBER = re.compile(r"^([A-Z]\w*|str|int|float|bool|none|(list|dict|tuple|set)\[.*\]|function-\w+\[.*\])$")


_TELLING = ("too_long", "value_error")


def from_validation_error(exc: pydantic.ValidationError, status: int) -> APIError:
    """The first problem, named by its field path (`messages.0.role`) in `param`."""
    errors = exc.errors(include_url=False)
    # A list over its length limit, or a field's own check, says more than a union's other members
    # ("should be a valid string") do about the same value.
    first = next((e for e in errors if e["type"] in _TELLING), errors[0])
    param = ".".join(str(part) for part in first["loc"] if not _UNION_MEMBER.match(str(part))) or None
    text = first["msg"].removeprefix("Value error, ")  # our own validators' words, as they wrote them
    message = text if param is None else f"{param}: {text}"
    more = len(errors) - 1
    if more:
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return APIError(status, message, param)
