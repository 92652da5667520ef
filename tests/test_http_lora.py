"""LoRA adapters through the server: loaded at start and while serving, listed, selected by
`model`, `lora_path` and `lora_request`, refused with what is wrong, unloaded under traffic
without a leak, and reported in /metrics (vLLM's lora_requests_info)."""
from __future__ import annotations

import functools
import tempfile

import openai
import pytest
import trio
from lora_support import make_adapter, reference

from fuzz_support import fuzz
from http_support import EXACT, frozen_engine, live_server, metric_value, settled_stats
from http_support import TOKEN_PROMPT as PROMPT
from http_support import greedy_ids as greedy
from trillm.config import EngineArgs
from trillm.engine.core import EngineCore



@functools.cache
def lora_core(model_dir: str, adapter: str) -> EngineCore:
    return EngineCore(EngineArgs(model=model_dir, num_kv_blocks=128, max_model_len=96, enable_lora=True, max_loras=2,
                                 lora_modules=f"one={adapter}", **EXACT))


@pytest.fixture
def adapters(tiny_text_model_dir):
    return {name: make_adapter(tiny_text_model_dir, seed=seed) for name, seed in (("one", 1), ("two", 2), ("three", 3))}


@pytest.fixture
async def lora_server(tiny_text_model_dir, adapters):
    async with live_server(lora_core(tiny_text_model_dir, adapters["one"]), allow_runtime_lora=True,
                           allowed_weights_dir=tempfile.gettempdir()) as server:
        yield server
        for name in ("two", "three"):  # back to the adapters the core started with
            if name in server.state.engine.core.loras.adapters:
                await server.state.engine.weights.unload_lora(name)


async def test_adapters_are_listed_served_loaded_and_unloaded(lora_server, tiny_text_model_dir, adapters):
    client, http = lora_server.openai(), lora_server.http()
    base = lora_server.model
    cards = {m.id: m for m in (await client.models.list()).data}
    assert set(cards) == {base, "one"}
    assert cards["one"].model_extra["parent"] == base and cards["one"].model_extra["root"] == adapters["one"]
    assert await greedy(client, "one") == reference(tiny_text_model_dir, adapters["one"], PROMPT, 8)[0]
    assert await greedy(client, base) == reference(tiny_text_model_dir, None, PROMPT, 8)[0]

    response = await http.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": adapters["two"]})
    assert response.status_code == 200 and "two" in response.text
    assert {m.id for m in (await client.models.list()).data} == {base, "one", "two"}
    chat = await client.chat.completions.create(model="two", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=4, temperature=0)
    assert chat.model == "two"
    assert await greedy(client, "two") == reference(tiny_text_model_dir, adapters["two"], PROMPT, 8)[0]

    assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "two"})).status_code == 200
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await greedy(client, "two")
    assert {m.id for m in (await client.models.list()).data} == {base, "one"}
    response = await http.post("/v1/unload_lora_adapter", json={"lora_name": "two"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "lora_name"


async def test_load_inplace_gives_a_name_new_weights(lora_server, tiny_text_model_dir, adapters):
    http, client = lora_server.http(), lora_server.openai()
    await http.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": adapters["two"]})
    assert await greedy(client, "two") == reference(tiny_text_model_dir, adapters["two"], PROMPT, 8)[0]
    body = {"lora_name": "two", "lora_path": adapters["three"], "load_inplace": True}
    assert (await http.post("/v1/load_lora_adapter", json=body)).status_code == 200
    assert await greedy(client, "two") == reference(tiny_text_model_dir, adapters["three"], PROMPT, 8)[0]
    cards = {m.id: m for m in (await client.models.list()).data}
    assert cards["two"].model_extra["root"] == adapters["three"]


async def test_lora_path_and_lora_request_choose_the_adapter(lora_server, tiny_text_model_dir, adapters):
    http, client = lora_server.http(), lora_server.openai()
    body = {"input_ids": [PROMPT, PROMPT], "lora_path": ["one", None],
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    results = (await http.post("/generate", json=body)).json()
    expected = [reference(tiny_text_model_dir, adapter, PROMPT, 5)[0] for adapter in (adapters["one"], None)]
    assert [r["output_ids"] for r in results] == expected
    bad = await http.post("/generate", json={**body, "lora_path": "nope"})
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "lora_path"
    # TensorRT-LLM's lora_request: an adapter not loaded yet comes from its lora_path
    request = {"lora_name": "three", "lora_int_id": 3, "lora_path": adapters["three"]}
    tokens = await greedy(client, lora_server.model, lora_request=request)
    assert tokens == reference(tiny_text_model_dir, adapters["three"], PROMPT, 8)[0]
    assert "three" in lora_server.state.engine.core.loras.adapters
    with pytest.raises(openai.NotFoundError):
        await greedy(client, lora_server.model, lora_request={"lora_name": "four"})


async def test_bad_adapters_are_400s_that_say_what_is_wrong(lora_server, tiny_text_model_dir, tmp_path):
    http = lora_server.http()
    cases = {
        str(tmp_path): "has no adapter_config.json",
        make_adapter(tiny_text_model_dir, seed=7, rank=32): "rank 32",
        make_adapter(tiny_text_model_dir, seed=8, modules=("q_proj", "lm_head")): "lm_head",
    }
    for path, words in cases.items():
        response = await http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path})
        assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
    again = await http.post("/v1/load_lora_adapter", json={"lora_name": "one", "lora_path": str(tmp_path)})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert set(lora_server.state.engine.core.loras.adapters) == {"one"}


async def test_unloading_an_adapter_that_requests_use_is_refused_then_allowed(lora_server, adapters):
    http, client = lora_server.http(), lora_server.openai()
    await http.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": adapters["two"]})
    core = lora_server.state.engine.core
    async with trio.open_nursery() as nursery:
        with frozen_engine(core):
            nursery.start_soon(functools.partial(greedy, client, "two", max_tokens=3))
            with trio.fail_after(30):  # admitted: waiting as of the last stats, or running
                while not {"running", "waiting"} & (labels := {
                        kind for kind in ("running", "waiting")
                        if "two" in getattr(lora_server.state.engine.stats(), f"{kind}_lora_adapters")}):
                    await trio.sleep(0.01)
            (kind,) = labels
            info = await metric_value(http, "trillm:lora_requests_info", **{f"{kind}_lora_adapters": "two"}, max_lora="2")
            assert info > 0
            refused = await http.post("/v1/unload_lora_adapter", json={"lora_name": "two"})
            assert refused.status_code == 400 and "in use by 1 running requests" in refused.json()["error"]["message"]
    assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "two"})).status_code == 200


async def test_an_adapter_unloaded_before_its_request_is_admitted_is_a_404(lora_server, adapters):
    """The route finds the adapter, the engine is busy in a step, the adapter is unloaded before
    the request's admission: the admission's refusal is still a 404 naming `model`."""
    http, client = lora_server.http(), lora_server.openai()
    await http.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": adapters["two"]})
    engine = lora_server.state.engine
    outcome = []

    async def late():
        try:
            await greedy(client, "two", max_tokens=2)
        except openai.NotFoundError as exc:
            outcome.append(exc.body["param"])

    async with trio.open_nursery() as nursery:
        with frozen_engine(lora_server.state.engine.core):
            nursery.start_soon(functools.partial(greedy, client, lora_server.model, max_tokens=3))
            with trio.fail_after(30):
                while not engine._link.stepping:  # the base request's step is held
                    await trio.sleep(0.01)
            nursery.start_soon(late)
            with trio.fail_after(30):
                while not engine._link.commands:  # its admission waits for the step to end
                    await trio.sleep(0.01)
            assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "two"})).status_code == 200
    assert outcome == ["model"]


async def test_loading_and_unloading_under_traffic_leaks_nothing(lora_server, tiny_text_model_dir, adapters):
    http, client = lora_server.http(), lora_server.openai()
    baseline = await settled_stats(http)
    expected = {name: reference(tiny_text_model_dir, adapters.get(name), PROMPT, 4)[0]
                for name in ("one", "two", lora_server.model)}
    wrong = []

    async def traffic(model):
        for _ in range(4):
            try:
                tokens = await greedy(client, model, max_tokens=4)
            except openai.NotFoundError:
                assert model == "two"  # unloaded at that moment
                continue
            if tokens != expected[model]:
                wrong.append(model)

    async with trio.open_nursery() as nursery:
        for model in ("one", "two", lora_server.model, "one"):
            nursery.start_soon(traffic, model)
        for _ in range(4):
            await http.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": adapters["two"]})
            await trio.sleep(0.05)
            while (await http.post("/v1/unload_lora_adapter", json={"lora_name": "two"})).status_code == 400:
                await trio.sleep(0.01)  # in use: retried once its requests end
    assert not wrong
    stats = await settled_stats(http)
    assert stats["num_used_blocks"] == 0
    assert stats["num_lora_adapters"] == baseline["num_lora_adapters"] == 1
    assert stats["lora_memory_bytes"] == baseline["lora_memory_bytes"]


async def test_a_server_without_lora_refuses_adapters(server, adapters):
    http = server.http()
    response = await http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["one"]})
    assert response.status_code == 403 and "--allow-runtime-lora" in response.json()["error"]["message"]
    generate = await http.post("/generate", json={"text": "Hi", "lora_path": "x"})
    assert generate.status_code == 404


async def test_fuzzed_adapter_and_weight_bodies_get_4xx_never_5xx(lora_server):
    """schemathesis on the routes that load and unload adapters and update weights, on a server
    with LoRA on: every body it makes is refused or served, never a 5xx, and the adapters and
    weights stay as they were."""
    http = lora_server.http()
    doc = (await http.get("/openapi.json")).json()
    routes = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/update_weights", "/update_weights_from_disk")
    doc["paths"] = {path: ops for path, ops in doc["paths"].items() if path in routes}
    counts: dict[int, int] = {}
    await trio.to_thread.run_sync(fuzz, lora_server.url, doc, counts, 25)
    assert counts.get(4) and not counts.get(5)
    assert set(lora_server.state.engine.core.loras.adapters) == {"one"}
    assert (await http.get("/health")).status_code == 200
