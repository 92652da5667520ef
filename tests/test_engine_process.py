"""The engine core in a process of its own (trillm/engine/core_process.py), behind the real server
and the real clients: what it serves equals what the core in the server's process serves, byte
for byte; a client that leaves frees its blocks over there; the engine's death fails every
stream with a final error and /health says so; `trillm serve --engine-process` drains on SIGTERM
and leaves no process behind."""
import os
import signal
import sys
import tempfile
import threading

import openai
import pytest
import trio

from http_support import (EXACT, NUM_KV_BLOCKS, SETTLE_TIMEOUT, finish_of_stream, greedy_ids, live_server, metric_value,
                          settled_stats)
from lora_support import make_adapter
from process_support import children, live, multiprocessing_helper, resident_bytes, start_server, started_by
from trillm.config import EngineArgs
from trillm.engine.api import EngineCore, EngineProcess, EngineUnavailableError

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "rank": {"type": "integer"}},
          "required": ["city", "rank"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine_process():
    with EngineProcess(EngineArgs(num_kv_blocks=NUM_KV_BLOCKS, enable_sleep_mode=True)) as process:
        yield process


async def both(engine_process, core, ask):
    """`ask(server)`'s answer from a server on each engine: in its own process, and in this one."""
    answers = []
    for engine in (engine_process, core):
        async with live_server(engine) as server:
            answers.append(await ask(server))
    return answers


async def test_serves_what_the_core_in_this_process_serves(engine_process, core):
    async def ask(server):
        client = server.openai()
        ids = await greedy_ids(client, server.model, max_tokens=24)
        sampled = await client.completions.create(
            model=server.model, prompt="Once upon a time", max_tokens=12, n=2, seed=7, temperature=0.8,
            logprobs=2, stop=["\n\n"], extra_body={"prompt_logprobs": 1})
        chat = await client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Name a city and its rank."}], max_tokens=40,
            temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
        chunks = await client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0,
            stream=True)
        # the text, not its chunks: where they break depends on timing (a reader that falls behind
        # takes what it missed at once; a step that verifies drafts brings several tokens)
        streamed = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        vectors = await client.embeddings.create(model=server.model, input=["a", "b c"], encoding_format="float")
        return (ids, [c.model_dump(exclude={"id"}) for c in sampled.choices], sampled.model_extra,
                chat.choices[0].message.content, streamed, [d.embedding for d in vectors.data])

    remote, local = await both(engine_process, core, ask)
    assert remote == local
    assert len(remote[1]) == 2 and remote[1][0]["logprobs"]["top_logprobs"], "both samples, with their logprobs"
    assert '"city"' in remote[3], "the grammar compiled here held the engine's sampling there"


async def test_refusals_come_from_the_server_at_once(engine_process):
    async with live_server(engine_process) as server:
        http = server.http()
        too_long = await http.post("/v1/completions", json={"model": server.model, "prompt": "hi",
                                                            "max_tokens": 10 ** 6})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
        no_adapter = await http.post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2,
                                                              "lora_request": {"lora_name": "x"}})
        assert no_adapter.status_code in (400, 404), no_adapter.text
        assert (await http.post("/reset_prefix_cache")).status_code == 200
        # the engine's gauges come with its Rounds; the server's counters are its own
        await greedy_ids(server.openai(), server.model, max_tokens=3)
        metrics = (await http.get("/metrics")).text
        assert "trillm:num_requests_running{" in metrics and "trillm:kv_cache_usage_perc{" in metrics
        assert await metric_value(http, "trillm:generation_tokens_total") == 3
        assert (await settled_stats(http))["num_steps"] >= 3


async def test_sleep_frees_the_engines_memory_and_wakes_to_the_same_tokens(engine_process):
    pid = engine_process.process.pid
    async with live_server(engine_process) as server:
        client, http = server.openai(), server.http()
        before = await greedy_ids(client, server.model, max_tokens=8)
        awake = resident_bytes(pid)
        response = await http.post("/sleep?level=2")
        assert response.status_code == 200, response.text
        freed = response.json()["freed_bytes"]
        assert freed > 80 << 20 and awake - resident_bytes(pid) > freed * 0.8, "the weights left the engine's process"
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
        assert (await http.get("/server_info")).json()["stats"]["is_sleeping"] is True
        with pytest.raises(openai.APIStatusError, match="sleeping"):
            await greedy_ids(client, server.model)
        assert (await http.post("/wake_up?tags=kv_cache")).json() == {"is_sleeping": True}, "the weights still sleep"
        assert (await http.post("/wake_up")).json() == {"is_sleeping": False}
        assert await greedy_ids(client, server.model, max_tokens=8) == before


async def test_lora_adapters_load_serve_and_unload_across_the_process_boundary(tiny_text_model_dir):
    one, two = (make_adapter(tiny_text_model_dir, seed=seed) for seed in (1, 2))
    args = EngineArgs(model=tiny_text_model_dir, num_kv_blocks=64, max_model_len=96, enable_lora=True, max_loras=2,
                      lora_modules=f"one={one}", **EXACT)
    settings = dict(allow_runtime_lora=True, allowed_weights_dir=tempfile.gettempdir())

    async def ask(server):
        client, http = server.openai(), server.http()
        loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": two})
        assert loaded.status_code == 200, loaded.text
        listed = sorted(m.id for m in (await client.models.list()).data)
        answers = [await greedy_ids(client, name) for name in (server.model, "one", "two")]
        unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "two"})
        gone = await http.post("/v1/completions", json={"model": "two", "prompt": "hi", "max_tokens": 1})
        again = await http.post("/v1/unload_lora_adapter", json={"lora_name": "two"})
        stats = (await http.get("/server_info")).json()["stats"]
        return listed, answers, unloaded.status_code, gone.status_code, again.status_code, stats["num_lora_adapters"]

    with EngineProcess(args) as process:
        async with live_server(process, **settings) as server:
            remote = await ask(server)
    with EngineCore(args) as core:
        async with live_server(core, **settings) as server:
            local = await ask(server)
    assert remote == local
    listed, answers, *statuses, num_adapters = remote
    assert {"one", "two"} <= set(listed) and len({tuple(a) for a in answers}) == 3, "each adapter changes the output"
    assert statuses == [200, 404, 404] and num_adapters == 1


async def test_a_client_that_leaves_frees_its_blocks_in_the_engines_process(engine_process):
    async with live_server(engine_process) as server:
        client, http = server.openai(), server.http()
        chunks = await client.completions.create(model=server.model, prompt="A long story:", max_tokens=2000,
                                                 stream=True, extra_body={"ignore_eos": True})
        seen = 0
        async for _ in chunks:
            seen += 1
            if seen == 5:
                break
        await chunks.response.aclose()
        with trio.fail_after(SETTLE_TIMEOUT):
            while (stats := await settled_stats(http))["num_used_blocks"]:
                await trio.sleep(0.02)
        assert stats["num_running"] == stats["num_waiting"] == 0, stats


async def test_the_engine_outlives_its_starter_thread_and_its_death_ends_every_stream(tiny_text_model_dir):
    """The parent-death signal follows the thread that started a child, not its process: started
    from a worker thread that then ends (Trio's end after 10 s idle), the engine must live on;
    its death, later, fails every stream with a final error, and /health says so."""
    started = []
    thread = threading.Thread(target=lambda: started.append(EngineProcess(EngineArgs(model=tiny_text_model_dir,
                                                                                     num_kv_blocks=64))))
    thread.start()
    thread.join()
    (process,) = started
    with process:
        await trio.sleep(0.5)  # the signal, were it sent, has landed
        assert process.process.is_alive()
        async with live_server(process) as server:
            client, http = server.openai(), server.http()
            assert (await http.get("/health")).status_code == 200
            ended = []

            async def stream(i: int) -> None:
                # thousands of tokens in all: far more than can come before the kill lands
                chunks = await client.completions.create(model=server.model, prompt=[10 + i, 11], max_tokens=200, n=4,
                                                         stream=True, extra_body={"ignore_eos": True})
                with pytest.raises(openai.APIError) as failed:
                    async for _ in chunks:
                        streaming.add(i)
                ended.append(str(failed.value))

            streaming = set()
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(stream, i)
                with trio.fail_after(SETTLE_TIMEOUT):
                    while len(streaming) < 3:
                        await trio.sleep(0)
                os.kill(process.process.pid, signal.SIGKILL)
            assert len(ended) == 3 and all("engine's process exited" in e for e in ended), ended
            health = await http.get("/health")
            assert health.status_code == 503 and "exited" in health.json()["error"]["message"]
            refused = await http.post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503
            with pytest.raises(EngineUnavailableError):
                await server.state.engine.reset_prefix_cache()
    process.close()  # closing twice is harmless


async def test_serve_with_the_engines_process_and_its_ranks_drains_on_sigterm_and_leaves_nothing(
        tiny_text_model_dir):
    """Tensor-parallel ranks start from the engine's process (not a daemon, so that it may have
    children); on SIGTERM the running request finishes, then every process ends."""
    command = [sys.executable, "-m", "trillm", "serve", "--engine-process", "--port", "0", "--model",
               tiny_text_model_dir, "--num-kv-blocks", "64", "--drain-timeout", "60", "--tensor-parallel-size", "2"]
    async with trio.open_nursery() as nursery:
        process, url, log = await start_server(nursery, command)
        engine_pids = started_by(process.pid)
        (engine,) = {p for p in children(process.pid) if not multiprocessing_helper(p)}
        assert started_by(engine), "the other rank runs beside the engine's process, started by it"
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        model = (await client.models.list()).data[0].id

        async def stop() -> None:
            process.send_signal(signal.SIGTERM)
            for pid in engine_pids:  # as a service manager sends it to every process: the engine steps on
                os.kill(pid, signal.SIGTERM)

        finish, _ = await finish_of_stream(client, model, 60, stop)
        assert finish == "length", "the drain let the running request finish in the engine's process"
        assert any("draining" in line for line in log), "\n".join(log)
        await client.close()
        with trio.fail_after(SETTLE_TIMEOUT):
            assert await process.wait() == 0, "\n".join(log)
        with trio.fail_after(SETTLE_TIMEOUT):
            while any(live(pid) for pid in engine_pids):
                await trio.sleep(0.05)
