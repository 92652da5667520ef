"""Embeddings, pooling, score and rerank from the same server that chats, through the real
`openai` client where it has a method (embeddings.create) and httpx elsewhere."""
import base64

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import trio
from transformers import AutoModel

from http_support import exact_core, frozen_engine, live_server, settled_stats
from fuzz_support import assert_openai_error

TEXTS = ["A cat sleeps on the warm windowsill.", "Stock markets fell sharply on Monday.", "Kittens nap in the sun."]


def assert_vectors_close(got, want, tol=1e-5):
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=tol, rtol=tol)


def hf_last_hidden(model_dir: str, ids: list[int]) -> torch.Tensor:
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).last_hidden_state[0]


async def test_embeddings_of_the_default_model_equal_transformers(default_model_dir):
    core = exact_core(default_model_dir)
    async with live_server(core) as server:
        client = server.openai()
        out = await client.embeddings.create(model=server.model, input=TEXTS, encoding_format="float")
        assert [d.index for d in out.data] == [0, 1, 2] and out.model == server.model
        ids = [core.tokenizer.encode(t) for t in TEXTS]
        assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
        for d, token_ids in zip(out.data, ids):
            want = F.normalize(hf_last_hidden(default_model_dir, token_ids)[-1], dim=0)  # last pooling, the default
            torch.testing.assert_close(torch.tensor(d.embedding), want, atol=1e-4, rtol=1e-4)
        # base64 is the same float32 vector; the SDK asks for it by default and decodes it.
        packed = await client.embeddings.create(model=server.model, input=TEXTS[0])
        assert_vectors_close(packed.data[0].embedding, out.data[0].embedding, 1e-6)
        raw = (await server.http().post("/v1/embeddings", json={
            "input": TEXTS[0], "encoding_format": "base64"})).json()["data"][0]["embedding"]
        assert_vectors_close(np.frombuffer(base64.b64decode(raw), dtype="<f4").tolist(), out.data[0].embedding, 1e-6)
        # dimensions: the first k, renormalised.
        short = await client.embeddings.create(model=server.model, input=TEXTS[0], dimensions=16, encoding_format="float")
        want = F.normalize(torch.tensor(out.data[0].embedding[:16]), dim=0)
        torch.testing.assert_close(torch.tensor(short.data[0].embedding), want, atol=1e-5, rtol=1e-5)
        # token ids, one list or several.
        by_ids = await client.embeddings.create(model=server.model, input=ids, encoding_format="float")
        assert_vectors_close([d.embedding for d in by_ids.data], [d.embedding for d in out.data])
        assert (await settled_stats(server.http()))["num_used_blocks"] == 0


async def test_embeddings_of_a_tiny_qwen3_equal_transformers(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3")
    async with live_server(exact_core(model_dir)) as server:
        ids = [[5, 9, 31, 7, 100, 3], [44, 2, 250, 17]]
        out = await server.openai().embeddings.create(model=server.model, input=ids, encoding_format="float")
        for d, token_ids in zip(out.data, ids):
            want = F.normalize(hf_last_hidden(model_dir, token_ids)[-1], dim=0)
            torch.testing.assert_close(torch.tensor(d.embedding), want, atol=1e-4, rtol=1e-4)


async def test_pooling_score_and_rerank_agree_with_embeddings(server):
    http = server.http()
    embedded = (await http.post("/v1/embeddings", json={"model": server.model, "input": TEXTS})).json()
    unit = [torch.tensor(d["embedding"]) for d in embedded["data"]]
    pooled = (await http.post("/pooling", json={"model": server.model, "input": TEXTS})).json()
    assert [d["object"] for d in pooled["data"]] == ["pooling"] * 3
    raw = [torch.tensor(d["data"]) for d in pooled["data"]]
    assert raw[0].norm() > 1.5  # not normalised
    for r, u in zip(raw, unit):
        torch.testing.assert_close(F.normalize(r, dim=0), u, atol=1e-5, rtol=1e-5)

    scores = (await http.post("/v1/score", json={"model": server.model, "text_1": TEXTS[0], "text_2": TEXTS[1:]})).json()
    assert [d["index"] for d in scores["data"]] == [0, 1]
    assert [d["score"] for d in scores["data"]] == pytest.approx([float(unit[0] @ unit[1]), float(unit[0] @ unit[2])],
                                                                 abs=1e-4)
    pairs = (await http.post("/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]})).json()
    assert pairs["data"][1]["score"] == pytest.approx(float(unit[1] @ unit[2]), abs=1e-4)

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = (await http.post(path, json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1})).json()
        (best,) = ranked["results"]
        expected = max((1, 2), key=lambda i: float(unit[0] @ unit[i]))
        assert best["index"] == expected - 1 and best["document"]["text"] == TEXTS[expected]
        assert best["relevance_score"] == pytest.approx(float(unit[0] @ unit[expected]), abs=1e-4)
    whole = (await http.post("/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:], "return_documents": False})).json()
    assert len(whole["results"]) == 2 and "document" not in whole["results"][0]
    assert whole["results"][0]["relevance_score"] >= whole["results"][1]["relevance_score"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": "hi", "dimensions": 100000}, "dimensions"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": [[10**7]]}, "input"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/rerank", {"query": "a", "documents": []}, "documents"),
])
async def test_bad_embedding_requests_are_400s_naming_the_field(server, path, body, param):
    response = await server.http().post(path, json={"model": server.model, **body})
    assert response.status_code == 400, response.text
    assert_openai_error(400, response.json())
    assert response.json()["error"]["param"] == param


async def test_a_step_mixing_embeddings_and_chat_gives_each_its_result_alone(server):
    client = server.openai()
    chat_args = dict(model=server.model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=12,
                     temperature=0)
    alone_chat = (await client.chat.completions.create(**chat_args)).choices[0].message.content
    alone_embedding = (await client.embeddings.create(model=server.model, input=TEXTS, encoding_format="float")).data
    results = {}

    async def chat():
        results["chat"] = (await client.chat.completions.create(**chat_args)).choices[0].message.content

    async def embed():
        results["embed"] = (await client.embeddings.create(model=server.model, input=TEXTS, encoding_format="float")).data

    async with trio.open_nursery() as nursery:
        nursery.start_soon(chat)
        nursery.start_soon(embed)
    assert results["chat"] == alone_chat
    assert_vectors_close([d.embedding for d in results["embed"]], [d.embedding for d in alone_embedding])


async def test_a_client_gone_mid_batch_frees_every_block(server):
    http = server.http()
    engine = server.state.engine
    with frozen_engine(server.state.engine.core):
        with trio.move_on_after(1):
            await http.post("/v1/embeddings", json={"input": [t * 20 for t in TEXTS] * 4})
        assert engine.stats().num_live_requests == 1  # still in the engine when the client left
    stats = await settled_stats(http)
    assert stats["num_used_blocks"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
