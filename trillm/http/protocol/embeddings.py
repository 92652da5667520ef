"""The pooling routes' bodies: /v1/embeddings (and /pooling), /score, /rerank."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from trillm.http.protocol.common import Prompt, Strict, TextList


class EmbeddingRequest(Strict):
    """OpenAI's embeddings body (also /pooling's, as vLLM's)."""

    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # keep the first `dimensions`, then renormalise
    user: str | None = None


class ScoreRequest(Strict):
    """vLLM's /score: text_1 against each text_2 (one against many), or pair by pair (equal lists)."""

    model: str | None = None
    text_1: str | TextList
    text_2: str | TextList
    user: str | None = None


class RerankRequest(Strict):
    """The Jina / Cohere rerank body, as vLLM serves it at /rerank, /v1/rerank and /v2/rerank."""

    model: str | None = None
    query: str
    documents: TextList
    top_n: int | None = Field(None, ge=0)  # None or 0: every document
    return_documents: bool = True
    user: str | None = None
