"""POST /invocations: SageMaker's single route, as vLLM serves it. The body's shape picks the
API it is for (the first of these fields it holds): `messages` chat, `prompt` completions,
`input` embeddings, `text_1` score, `query` rerank. The chosen route then reads the body as its
own, so its answer, errors included, is that route's."""
from __future__ import annotations

from quart import Blueprint

from trillm.http import embeddings, openai_chat, openai_completions
from trillm.http.errors import APIError
from trillm.http.state import read_json

blueprint = Blueprint("invocations", __name__)

ROUTES = (
    ("messages", openai_chat.chat_completions),
    ("prompt", openai_completions.completions),
    ("input", embeddings.embeddings),
    ("text_1", embeddings.score),
    ("query", embeddings.rerank),
)


@blueprint.post("/invocations")
async def invocations():
    body = await read_json()
    if isinstance(body, dict):
        for field, route in ROUTES:
            if field in body:
                return await route()
    fields = ", ".join(f for f, _ in ROUTES)
    raise APIError(400, f"Cannot tell which API this body is for: it holds none of {fields}.")
