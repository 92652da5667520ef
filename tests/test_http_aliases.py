"""The routes users reach for by the peers' names, against a live server: vLLM's
/reset_prefix_cache, SageMaker's /invocations (dispatched by the body's shape), and /v1/models
entries with vLLM's fields."""
from http_support import settled_stats

ASK = [{"role": "user", "content": "Name a color."}]
LONG_PROMPT = "Once upon a time, " * 40  # several full blocks, so the prefix cache has something to keep


async def test_reset_prefix_cache_empties_it(server):
    client = server.openai()

    async def cached() -> int:
        out = await client.completions.create(model=server.model, prompt=LONG_PROMPT, max_tokens=1)
        await settled_stats(server.http())
        return out.usage.prompt_tokens_details.cached_tokens

    await cached()
    assert await cached() > 0
    response = await server.http().post("/reset_prefix_cache")
    assert response.status_code == 200
    assert await cached() == 0


async def test_invocations_dispatches_by_the_bodys_shape(server):
    http = server.http()
    chat = {"model": server.model, "messages": ASK, "max_tokens": 6, "temperature": 0}
    direct = (await http.post("/v1/chat/completions", json=chat)).json()
    routed = (await http.post("/invocations", json=chat)).json()
    assert routed["object"] == "chat.completion"
    assert routed["choices"][0]["message"] == direct["choices"][0]["message"]
    streamed = (await http.post("/invocations", json={**chat, "stream": True})).text
    assert streamed.startswith("data: ") and streamed.rstrip().endswith("data: [DONE]")

    completion = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    routed = (await http.post("/invocations", json=completion)).json()
    assert routed["object"] == "text_completion"
    assert routed["choices"][0]["text"] == (await http.post("/v1/completions", json=completion)).json()["choices"][0]["text"]

    embedded = (await http.post("/invocations", json={"input": ["a cat", "a dog"]})).json()
    direct = (await http.post("/v1/embeddings", json={"input": ["a cat", "a dog"]})).json()
    assert [d["embedding"] for d in embedded["data"]] == [d["embedding"] for d in direct["data"]]
    scored = (await http.post("/invocations", json={"text_1": "a cat", "text_2": ["a kitten", "a car"]})).json()
    assert [d["object"] for d in scored["data"]] == ["score", "score"]
    ranked = (await http.post("/invocations", json={"query": "a cat", "documents": ["a kitten", "a car"]})).json()
    assert len(ranked["results"]) == 2

    unknown = await http.post("/invocations", json={"nothing": 1})
    assert unknown.status_code == 400 and "messages" in unknown.json()["error"]["message"]
    bad = await http.post("/invocations", json={"messages": ASK, "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


async def test_models_have_vllms_fields(server):
    (card,) = (await server.openai().models.list()).data
    assert card.id == server.model and card.object == "model"
    extra = card.model_extra
    assert extra["max_model_len"] == server.state.max_model_len and extra["parent"] is None and extra["root"]
    (permission,) = extra["permission"]
    assert permission["object"] == "model_permission" and permission["allow_sampling"] is True
