"""The weights' life cycle through the server: sleep (levels 1 and 2) and wake with the memory
measured (the resident set: the live server runs in this process), requests refused with a 503
while asleep, running ones aborted after the drain timeout; updating the weights in place, with
bad updates refused and the old weights serving on."""
from __future__ import annotations

import functools
import os
import shutil

import openai
import pytest
import torch
import trio
from lora_support import reference

from http_support import EXACT, live_server, settled_stats
from http_support import TOKEN_PROMPT as PROMPT
from http_support import greedy_ids as greedy
from process_support import resident_bytes
from trillm.config import EngineArgs
from trillm.engine.api import EngineCore, EngineProcess



@functools.cache
def sleepy_core() -> EngineCore:
    """The default model, as served with --enable-sleep-mode."""
    return EngineCore(EngineArgs(num_kv_blocks=128, enable_sleep_mode=True))


@pytest.mark.parametrize("level, route", [(1, "/wake_up"), (2, "/wakeup")])
async def test_sleep_frees_memory_refuses_requests_and_wakes_to_the_same_tokens(level, route):
    core = sleepy_core()
    async with live_server(core) as server:
        client, http = server.openai(), server.http()
        long_prompt = list(range(1000, 1900))  # 900 tokens: their KV (fp16) is ~20 MiB resident
        before_tokens = await greedy(client, server.model, long_prompt)
        awake = resident_bytes()
        response = await http.post(f"/sleep?level={level}")
        assert response.status_code == 200, response.text
        freed = response.json()["freed_bytes"]
        asleep = resident_bytes()
        # level 1: the KV cache's written pages; level 2: the weights too (the GGUF blocks alone are ~100 MiB)
        assert freed > (15 << 20 if level == 1 else 80 << 20), freed
        assert awake - asleep > freed * 0.8
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/server_info")).json()["stats"]["is_sleeping"] is True
        with pytest.raises(openai.APIStatusError, match="sleeping") as refused:
            await greedy(client, server.model, PROMPT)
        assert refused.value.status_code == 503
        assert (await http.post(route)).json() == {"is_sleeping": False}
        # level 2: the weights are back, 106 MiB of kernel blocks, some of them in heap pages the
        # process held through the sleep (level 1's KV cache comes back as untouched pages)
        if level == 2:
            assert resident_bytes() > asleep + (64 << 20)
        assert await greedy(client, server.model, long_prompt) == before_tokens
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": False}


@pytest.mark.parametrize("first, then", [("weights", "kv_cache"), ("kv_cache", "weights")])
async def test_waking_by_tags_serves_once_both_are_back(first, then):
    """vLLM's tags wake one part at a time, in either order (the cache's layout outlives the model)."""
    core = sleepy_core()
    async with live_server(core) as server:
        http, client = server.http(), server.openai()
        expected = await greedy(client, server.model, PROMPT)
        assert (await http.post("/sleep?level=2")).status_code == 200
        assert (await http.post(f"/wake_up?tags={first}")).json() == {"is_sleeping": True}
        assert (await http.post(f"/wake_up?tags={then}")).json() == {"is_sleeping": False}
        assert await greedy(client, server.model, PROMPT) == expected
        bad = await http.post("/wake_up?tags=everything")
        assert bad.status_code == 400 and "tags" in bad.json()["error"]["message"]
        assert (await http.post("/sleep?level=3")).json()["error"]["param"] == "level"


async def test_sleeping_aborts_running_requests_after_the_drain_timeout():
    core = sleepy_core()
    async with live_server(core, drain_timeout=0.3) as server:
        client, http = server.openai(), server.http()
        stream = await client.completions.create(model=server.model, prompt=PROMPT, max_tokens=200, stream=True,
                                                 extra_body={"ignore_eos": True})
        reasons = []

        async def read():
            async for chunk in stream:
                reasons.extend(c.finish_reason for c in chunk.choices if c.finish_reason)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.sleep(0.2)
            assert (await http.post("/sleep?level=1")).status_code == 200
        assert reasons == ["abort"]
        stats = await settled_stats(http)
        assert stats["num_used_blocks"] == 0
        await http.post("/wake_up")


async def test_a_server_without_sleep_mode_refuses_to_sleep(server):
    response = await server.http().post("/sleep")
    assert response.status_code == 400 and "--enable-sleep-mode" in response.json()["error"]["message"]


@pytest.fixture(scope="module")
def first_model_dir(tiny_text_model_factory) -> str:
    """The tiny text model, with room for requests that run for seconds."""
    return tiny_text_model_factory(max_position_embeddings=4096)


@pytest.fixture(scope="module")
def second_model_dir(first_model_dir, tmp_path_factory) -> str:
    """The first model's architecture with other random weights (and the same tokenizer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(first_model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    path = str(tmp_path_factory.mktemp("second"))
    model.save_pretrained(path)
    for name in os.listdir(first_model_dir):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(first_model_dir, name), path)
    return path


@pytest.fixture
async def updatable(request, first_model_dir, second_model_dir):
    """A server whose weights may be updated; its core in this process, or (`process`, given
    indirectly) in one of its own, where the new weights load beside the engine's steps."""
    args = EngineArgs(model=first_model_dir, num_kv_blocks=256, max_model_len=4096, **EXACT)
    root = os.path.commonpath([first_model_dir, second_model_dir])  # both under the session's tmp dir
    with (EngineProcess if getattr(request, "param", None) == "process" else EngineCore)(args) as core:
        async with live_server(core, enable_weight_updates=True, allowed_weights_dir=root) as server:
            yield server


@pytest.mark.parametrize("updatable", ["thread", "process"], indirect=True)
async def test_updated_weights_serve_as_that_model_alone(updatable, first_model_dir, second_model_dir):
    client, http = updatable.openai(), updatable.http()
    first = reference(first_model_dir, None, PROMPT, 8)[0]
    second = reference(second_model_dir, None, PROMPT, 8)[0]
    assert first != second
    assert await greedy(client, updatable.model, PROMPT) == first
    await greedy(client, updatable.model, PROMPT * 5)  # 40 tokens: two full blocks enter the prefix cache
    assert (await settled_stats(http))["num_cached_blocks"] > 0
    response = await http.post("/update_weights_from_disk", json={"model_path": second_model_dir})
    assert response.status_code == 200 and response.json()["success"] is True
    assert (await settled_stats(http))["num_cached_blocks"] == 0  # the old weights' KV is gone
    assert await greedy(client, updatable.model, PROMPT) == second
    assert (await http.get("/model_info")).json()["model_path"] == second_model_dir
    assert (await client.models.list()).data[0].model_extra["root"] == second_model_dir


async def test_bad_updates_are_400s_and_the_old_weights_keep_serving(updatable, first_model_dir, tiny_model_dir):
    client, http = updatable.openai(), updatable.http()
    expected = reference(first_model_dir, None, PROMPT, 8)[0]
    other = tiny_model_dir("llama", vocab_size=49152, hidden_size=32)
    root = updatable.state.settings.allowed_weights_dir
    for path, words in ((os.path.join(root, "no-such-model"), "no model there"), (other, "hidden_size differs")):
        response = await http.post("/update_weights", json={"model_path": path})
        assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
        assert await greedy(client, updatable.model, PROMPT) == expected
    lmdeploy = await http.post("/update_weights", json={"serialized_named_tensors": "x", "finished": True})
    assert lmdeploy.status_code == 400


@pytest.mark.parametrize("abort_running, max_tokens", [(False, 400), (True, 4000)])
async def test_running_requests_finish_or_are_aborted_before_the_swap(updatable, first_model_dir,
                                                                      second_model_dir, abort_running, max_tokens):
    """The request is running when the update arrives (its first token is in) and outlasts the new
    weights' load, so the swap meets it: either it finishes whole on the old weights first, or it
    is aborted (a request of 4,000 tokens would run for seconds)."""
    client, http = updatable.openai(), updatable.http()
    stream = await client.completions.create(model=updatable.model, prompt=PROMPT, max_tokens=max_tokens, stream=True,
                                             temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    tokens, reasons = [], []
    running = trio.Event()

    async def read():
        async for chunk in stream:
            for choice in chunk.choices:
                tokens.extend(choice.model_extra.get("token_ids") or [])
                if choice.finish_reason:
                    reasons.append(choice.finish_reason)
            running.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await running.wait()
        body = {"model_path": second_model_dir, "abort_running": abort_running}
        response = await http.post("/update_weights", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["num_aborted_requests"] == int(abort_running)
    if abort_running:
        assert reasons == ["abort"] and len(tokens) < max_tokens
    else:  # it finished on the old weights, whole
        assert reasons == ["length"] and tokens == reference(first_model_dir, None, PROMPT, max_tokens)[0]
    assert await greedy(client, updatable.model, PROMPT) == reference(second_model_dir, None, PROMPT, 8)[0]


async def test_an_update_may_come_from_a_gguf_file(default_model_dir):
    """Serving the default model's converted directory, an update to its GGUF file serves the
    file's quantized blocks: the same greedy tokens (the blocks dequantize to the same weights)."""
    from trillm.model.loader import default_model_path

    core = EngineCore(EngineArgs(model=default_model_dir, num_kv_blocks=32, **EXACT))
    async with live_server(core, enable_weight_updates=True,
                           allowed_weights_dir=os.path.dirname(default_model_path())) as server:
        client, http = server.openai(), server.http()
        prompt = core.tokenizer.encode("The capital of France is")
        before = await greedy(client, server.model, prompt)
        assert core.runner.model.lm_head.quantized is None
        response = await http.post("/update_weights", json={"model_path": default_model_path()})
        assert response.status_code == 200, response.text
        assert core.runner.model.lm_head.quantized is not None  # on the file's blocks now
        assert (await http.get("/model_info")).json()["model_path"] == default_model_path()
        assert await greedy(client, server.model, prompt) == before
    core.close()
