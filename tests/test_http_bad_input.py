"""Bad input against a live server: the OpenAPI document, fuzzed bodies for every POST route, bodies
that are too large, not UTF-8 or not JSON. Every one is a 4xx with an OpenAI error body; none is
a 5xx, a hang, or an engine that stops answering.

The fuzzer (tests/fuzz_support.py) is schemathesis, reading the server's own /openapi.json.
"""
import re

import pytest
import trio
from fuzz_support import assert_openai_error, cases, fuzz_in_a_process, kept_cases, probe_health
from http_support import live_server, settled_stats, tiny_core
from openapi_spec_validator import validate

EXAMPLES_PER_ROUTE_AND_MODE = 24  # benchmarks/soak.py runs more


@pytest.fixture(scope="session")
def core(tiny_text_model_dir):
    """Overrides conftest's core; conftest's `server` then serves this one."""
    return tiny_core(tiny_text_model_dir)


async def test_openapi_document_is_valid_and_covers_every_post_route(server):
    doc = (await server.http().get("/openapi.json")).json()
    validate(doc)
    # The document spells path variables OpenAPI's way: /v1/responses/{response_id}/cancel.
    app_posts = {re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", r.rule)
                 for r in server.app.url_map.iter_rules() if "POST" in r.methods}
    doc_posts = {path for path, ops in doc["paths"].items() if "post" in ops}
    assert app_posts == doc_posts and "/v1/chat/completions" in doc_posts
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    completion = doc["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert completion["properties"]["n"]["maximum"] == 128 and "prompt" in completion["required"]


async def test_a_body_over_the_limit_is_413(core):
    async with live_server(core, max_body_bytes=4096) as server:
        http = server.http()
        prompt = [5] * 3000  # ~6 KB of JSON
        response = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert response.status_code == 413, response.text
        assert_openai_error(413, response.json())
        assert "4096 bytes" in response.json()["error"]["message"]
        small = await http.post("/v1/completions", json={"prompt": prompt[:10], "max_tokens": 1})
        assert small.status_code == 200


async def test_a_text_longer_than_any_context_allows_is_refused_before_it_is_tokenized(server):
    """A prompt whose length alone proves it cannot fit (each token covers at most the
    tokenizer's longest token's characters) is a 400 from that bound, on every route that
    tokenizes text, before any tokenizing: the message is the bound's, not the engine's count.
    One just under the bound is tokenized and refused by its count; a truncated one serves."""
    bound = server.state.prompt_bound
    assert bound.longest > 1 and bound.max_model_len == server.state.max_model_len
    # read id by id at start-up (no dict of the whole vocabulary), the vocabulary's longest token
    assert bound.longest == max(map(len, server.state.tokenizer.get_vocab()))
    long = "ab " * (bound.longest * bound.max_model_len // 3 + 1)
    http = server.http()
    calls = [("/v1/completions", {"prompt": long, "max_tokens": 1}),
             ("/v1/completions", {"prompt": ["Hi", long], "max_tokens": 1}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}], "max_tokens": 1}),
             ("/v1/messages", {"messages": [{"role": "user", "content": long}], "max_tokens": 1}),
             ("/v1/responses", {"input": long, "max_output_tokens": 1}), ("/v1/embeddings", {"input": long})]
    for path, body in calls:
        response = await http.post(path, json={"model": server.model, **body})
        assert response.status_code == 400, (path, response.text)
        message = response.text
        assert f"at most {bound.longest} characters" in message and "at least" in message, (path, message)
    under = await http.post("/v1/completions", json={"model": server.model, "max_tokens": 1,
                                                     "prompt": "ab " * bound.max_model_len})
    assert under.status_code == 400 and "characters" not in under.json()["error"]["message"]
    truncated = await http.post("/v1/completions", json={"model": server.model, "max_tokens": 1, "prompt": long,
                                                         "truncate_prompt_tokens": 8})
    assert truncated.status_code == 200, truncated.text
    assert truncated.json()["usage"]["prompt_tokens"] == 8


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b'{"prompt": "caf\xe9", "max_tokens": 1}', "UTF-8"),  # Latin-1, not UTF-8
        (b'\xff\xfe{\x00"\x00', "UTF-8"),  # UTF-16 with a BOM
        (b'{"prompt": [5, 6], "max_tokens": 1', "JSON"),
        (b"", "prompt"),  # no body: an empty object, which lacks the prompt
    ],
)
async def test_undecodable_bodies_are_400(server, data, words):
    response = await server.http().post("/v1/completions", content=data, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert_openai_error(400, response.json())
    assert words in response.json()["error"]["message"]


@pytest.mark.slow
@pytest.mark.quiet
async def test_fuzzed_bodies_get_4xx_never_5xx(server):
    """schemathesis's bodies, then hostile ones (deep nesting, duplicate keys, huge lists, other
    media types) to every POST route, while /health is probed: no 5xx, and no probe waits a
    second (the event loop never stalls that long)."""
    http = server.http()
    probes: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe_health, server.url, probes)
        counts = await fuzz_in_a_process(server.url, EXAMPLES_PER_ROUTE_AND_MODE)
        nursery.cancel_scope.cancel()
    print(f"fuzz: {sum(counts.values())} cases, by status class {dict(sorted(counts.items()))}; "
          f"{len(probes)} health probes, slowest {max(probes):.3f} s")
    assert counts.get(4) and counts.get(2), "the fuzzer reached both refusals and the engine"
    assert max(probes) < 1.0
    assert (await http.get("/health")).status_code == 200
    stats = await settled_stats(http)
    assert stats["num_used_blocks"] == 0 and stats["alive"]
    ok = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


async def test_the_fuzz_cases_repeat_exactly_so_kept_ones_are_the_ones_a_run_makes(server, tmp_path):
    """What lets a run send the cases an earlier one kept (fuzz_support's docstring)."""
    doc = (await server.http().get("/openapi.json")).json()
    doc["paths"] = {path: ops for path, ops in doc["paths"].items() if path in ("/abort_request", "/detokenize")}
    made = await trio.to_thread.run_sync(cases, doc, 5)
    assert len(made) == 20 and {path for path, _ in made} == {"/abort_request", "/detokenize"}
    kept = str(tmp_path / "kept.pickle")
    assert await trio.to_thread.run_sync(kept_cases, kept, doc, 5, (0, 1)) == made
    assert await trio.to_thread.run_sync(kept_cases, kept, {}, 5, (0, 1)) == made  # read back, not made


async def test_unknown_names_are_404(server):
    http = server.http()
    for path, body, param in (
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, "model"),
        ("/abort_request", {"rid": "never-was"}, "rid"),
    ):
        response = await http.post(path, json=body)
        assert response.status_code == 404 and response.json()["error"]["param"] == param
