"""POST /v1/embeddings (OpenAI's shape), /pooling (vLLM's: the raw pooled vectors), /score and
/v1/score (vLLM's), /rerank, /v1/rerank and /v2/rerank (Jina's and Cohere's shape, as vLLM serves
them): the cosine of embeddings.

Every input is a prefill-only engine request with the model's PoolingParams (ModelConfig's
pooling type): it shares steps, batching, the waiting limit, metrics and aborts with generation,
and a client that goes away aborts it as it aborts a chat (Generation.close frees its blocks).
The engine returns raw pooled vectors; normalising (unless --no-normalize-embeddings) and
`dimensions` (keep the first ones, then renormalise, as Matryoshka models are read) happen here.
"""
from __future__ import annotations

import base64
import time

import torch
import torch.nn.functional as F
from quart import Blueprint

from trillm.http.errors import APIError
from trillm.http.generation import Generation
from trillm.http.prompts import completion_prompts
from trillm.http.protocol.embeddings import EmbeddingRequest, RerankRequest, ScoreRequest
from trillm.http.state import ServerState, model_request, request_id
from trillm.pooling_params import PoolingParams
from trillm.sampling_params import SamplingParamError

blueprint = Blueprint("embeddings", __name__)


async def pooled_vectors(
    state: ServerState, prefix: str, prompts: list[list[int]], param: str, lora_name: str | None = None
) -> tuple[str, list[torch.Tensor]]:
    """The request's id, and each prompt's raw pooled vector, from one engine group; `param`
    names the client's field in errors; `lora_name`: the adapter to run under."""
    generation = Generation(state, *request_id(prefix), prompts, PoolingParams(state.engine.config.pooling_type),
                            field_names={"prompt": param}, lora_name=lora_name)
    await generation.start()
    await generation.run()
    vectors = [c.completion.pooled for c in generation.choices]
    if any(v is None for v in vectors):  # aborted: a drain, /abort_request
        raise APIError(503, "The request was aborted before its embeddings were computed.")
    return generation.request_id, vectors


def _prompts(state: ServerState, value, param: str) -> list[list[int]]:
    try:
        return completion_prompts(state.tokenizer, value, state.prompt_bound)
    except SamplingParamError as exc:
        raise SamplingParamError(param, str(exc), exc.status) from None


def _encode(vector: torch.Tensor, encoding_format: str):
    if encoding_format == "base64":  # little-endian float32, as OpenAI sends and its SDK decodes
        return base64.b64encode(vector.to(torch.float32).numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def _usage(prompts: list[list[int]]) -> dict:
    tokens = sum(map(len, prompts))
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _head(rid: str, state: ServerState) -> dict:
    return {"id": rid, "object": "list", "created": int(time.time()), "model": state.model_name}


def check_dimensions(state: ServerState, dimensions: int | None) -> None:
    hidden_size = state.engine.config.hf_config.hidden_size
    if dimensions is not None and dimensions > hidden_size:
        raise SamplingParamError("dimensions", f"dimensions must be at most this model's {hidden_size}.")


def trimmed(vectors: list[torch.Tensor], dimensions: int | None) -> list[torch.Tensor]:
    """Each vector's first `dimensions` (all without)."""
    return vectors if dimensions is None else [v[:dimensions] for v in vectors]


def normalized(state: ServerState, vectors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The vectors as embeddings are served: L2-normalised, unless --no-normalize-embeddings."""
    return [F.normalize(v, dim=0) for v in vectors] if state.settings.normalize_embeddings else vectors


async def _embedding_request(kind: str) -> tuple[EmbeddingRequest, ServerState, list[list[int]], str, list[torch.Tensor]]:
    state, req = await model_request(EmbeddingRequest)
    check_dimensions(state, req.dimensions)
    prompts = await state.off_loop(_prompts, state, req.input, "input")
    rid, vectors = await pooled_vectors(state, kind, prompts, "input", await state.requested_lora(req.model))
    return req, state, prompts, rid, trimmed(vectors, req.dimensions)


@blueprint.post("/v1/embeddings")
async def embeddings():
    req, state, prompts, rid, vectors = await _embedding_request("embd")
    vectors = normalized(state, vectors)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)} for i, v in enumerate(vectors)]
    return {**_head(rid, state), "data": data, "usage": _usage(prompts)}


@blueprint.post("/pooling")
async def pooling():
    """vLLM's pooling API: the raw pooled vectors, never normalised."""
    req, state, prompts, rid, vectors = await _embedding_request("pool")
    data = [{"object": "pooling", "index": i, "data": _encode(v, req.encoding_format)} for i, v in enumerate(vectors)]
    return {**_head(rid, state), "data": data, "usage": _usage(prompts)}


async def _cosines(state: ServerState, prefix: str, queries: list[str], documents: list[str], param: str):
    """cos(query i, document i) for each pair, embedding every distinct text once."""
    texts = list(dict.fromkeys(queries + documents))
    prompts = await state.off_loop(_prompts, state, texts, param)
    rid, vectors = await pooled_vectors(state, prefix, prompts, param)
    unit = dict(zip(texts, (F.normalize(v, dim=0) for v in vectors)))
    return rid, prompts, [float(unit[q] @ unit[d]) for q, d in zip(queries, documents)]


@blueprint.post("/score")
@blueprint.post("/v1/score")
async def score():
    state, req = await model_request(ScoreRequest)
    first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise SamplingParamError(
            "text_2", f"text_1 has {len(first)} texts and text_2 {len(second)}: send one text_1, or as many as text_2."
        )
    rid, prompts, scores = await _cosines(state, "score", first, second, "text_2")
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return {**_head(rid, state), "data": data, "usage": _usage(prompts)}


@blueprint.post("/rerank")
@blueprint.post("/v1/rerank")
@blueprint.post("/v2/rerank")
async def rerank():
    state, req = await model_request(RerankRequest)
    rid, prompts, scores = await _cosines(state, "rerank", [req.query] * len(req.documents), req.documents, "documents")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or None]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": req.documents[i]}
        results.append(result)
    return {"id": rid, "model": state.model_name, "usage": {"total_tokens": _usage(prompts)["total_tokens"]},
            "results": results}
