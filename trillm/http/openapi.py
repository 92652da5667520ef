"""GET /openapi.json: the server's OpenAPI 3.1 document, made from the routes and the pydantic
request models that validate them.

The paths come from the app's own URL map, so a new route shows up without an edit here; a
POST route must name its body model in BODIES (or be listed as bodiless), which an assert
enforces, so the document can never describe a body the route does not validate. Request
schemas are pydantic's own JSON Schema (2020-12, which OpenAPI 3.1 uses) with their `$defs`
moved into `components/schemas`, so fuzzers generate exactly what the routes parse.
"""
from __future__ import annotations

import re

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from quart import Blueprint, current_app

import trillm
from trillm.http.errors import ERROR_TYPES, OLLAMA_PREFIX
from trillm.http.protocol.anthropic import CountTokensRequest, MessagesRequest
from trillm.http.protocol.responses import ResponsesRequest
from trillm.http.protocol.admin import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, UpdateWeightsRequest
from trillm.http.protocol.chat import ChatCompletionRequest
from trillm.http.protocol.completions import CompletionRequest
from trillm.http.protocol.embeddings import EmbeddingRequest, RerankRequest, ScoreRequest
from trillm.http.protocol.native import AbortRequest, DetokenizeRequest, GenerateRequest, LMDeployGenerateRequest, TokenizeRequest
from trillm.http.protocol import ollama

blueprint = Blueprint("openapi", __name__)

# A route's body model, or the models it tells apart by the body's shape.
BODIES: dict[str, type[BaseModel] | tuple[type[BaseModel], ...]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/generate": (GenerateRequest, LMDeployGenerateRequest),
    "/invocations": (ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ScoreRequest, RerankRequest),
    "/abort_request": AbortRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/pooling": EmbeddingRequest,
    "/score": ScoreRequest,
    "/v1/score": ScoreRequest,
    "/rerank": RerankRequest,
    "/v1/rerank": RerankRequest,
    "/v2/rerank": RerankRequest,
    "/v1/load_lora_adapter": LoadLoRAAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest,
    "/update_weights": UpdateWeightsRequest,
    "/update_weights_from_disk": UpdateWeightsRequest,
    "/api/chat": ollama.ChatRequest,
    "/api/generate": ollama.GenerateRequest,
    "/api/embed": ollama.EmbedRequest,
    "/api/embeddings": ollama.EmbeddingsRequest,
    "/api/show": ollama.ShowRequest,
}
BODILESS_POSTS = {"/flush_cache", "/reset_prefix_cache", "/ping", "/v1/responses/<response_id>/cancel", "/sleep",
                  "/wake_up", "/wakeup"}
REF_TEMPLATE = "#/components/schemas/{model}"

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "enum": sorted(set(ERROR_TYPES.values()))},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}


# Ollama's routes answer errors in its one shape (trillm.http.errors)
OLLAMA_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}


def openapi_document(url_map) -> dict:
    """The document for the routes in `url_map` (a Quart app's)."""
    models = dict.fromkeys(m for body in BODIES.values() for m in (body if isinstance(body, tuple) else (body,)))
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF_TEMPLATE)
    schemas = {**defs.get("$defs", {}), "ErrorResponse": ERROR_SCHEMA, "OllamaErrorResponse": OLLAMA_ERROR_SCHEMA}
    paths: dict[str, dict] = {}
    for rule in url_map.iter_rules():
        if rule.endpoint == "static" or rule.rule == "/openapi.json":
            continue
        path = re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule.rule)
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            paths.setdefault(path, {})[method.lower()] = _operation(rule, path, method, refs)
    return {
        "openapi": "3.1.0",
        "info": {"title": "trillm", "version": trillm.__version__},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
    }


def _operation(rule, path: str, method: str, refs: dict) -> dict:
    operation: dict = {
        "operationId": method.lower() + re.sub(r"\W+", "_", path).rstrip("_"),  # /health and /ping share an endpoint
        "responses": {
            "200": {"description": "Success"},
            "default": _error_response(path),
        },
    }
    if rule.arguments:
        operation["parameters"] = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in sorted(rule.arguments)
        ]
    if rule.rule.startswith("/v1/"):
        operation["security"] = [{"bearerAuth": []}, {}]  # needed only when the server has an API key
    if method == "POST":
        body = BODIES.get(rule.rule)
        assert body is not None or rule.rule in BODILESS_POSTS, f"POST {rule.rule} must name its body model"
        if body is not None:
            schemas = [refs[(m, "validation")] for m in (body if isinstance(body, tuple) else (body,))]
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": schemas[0] if len(schemas) == 1 else {"anyOf": schemas}}},
            }
    return operation


def _error_response(path: str) -> dict:
    ollama_route = path.startswith(OLLAMA_PREFIX)
    return {"description": "An error, in Ollama's shape" if ollama_route else "An error, in OpenAI's shape",
            "content": {"application/json": {"schema": {"$ref": REF_TEMPLATE.format(
                model="OllamaErrorResponse" if ollama_route else "ErrorResponse")}}}}


@blueprint.get("/openapi.json")
async def openapi_json():
    return openapi_document(current_app.url_map)
