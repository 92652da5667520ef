"""`trillm serve --data-parallel-size 2` as a user runs it: two replicas behind vllm-router on
loopback, driven by the real `openai` client through the router, each replica's own /metrics
read to see where requests went. Cache-aware routing keeps requests that share a long prefix on
one replica, whose prefix cache then serves them, where round-robin splits them; a client that
leaves through the router frees the replica's blocks; a killed replica leaves the other serving;
SIGTERM stops the router and every replica."""
import logging
import os
import re
import signal
import socket
import subprocess
import sys

import httpx
import openai
import pytest
import trio
from http_support import live_server, metric_total, requests_served
from process_support import descendants, live, logged, started_by

from trillm.config import EngineArgs
from trillm.engine.core import EngineCore
from trillm.launch import data_parallel

pytest.importorskip("vllm_router")

SHARED = "You are a careful assistant. " * 30  # a prefix of many blocks, sent before each question


async def prefix_hits(url: str) -> float:
    return await metric_total(url, "trillm:prefix_cache_hits_total", always_reported=True)


async def start_replicated(nursery, model: str, policy: str, *flags: str, env: dict | None = None):
    command = [sys.executable, "-m", "trillm", "serve", "--model", model, "--port", "0", "--num-kv-blocks", "64",
               "--data-parallel-size", "2", "--router-policy", policy, *flags]
    # The supervisor logs each replica's URL, then the router's address once it is up.
    process = await nursery.start(lambda task_status: trio.run_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False, env=env, task_status=task_status))
    log: list[str] = []
    ready = trio.Event()

    async def read_log():
        buffer = b""
        async for data in process.stdout:
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            log.extend(line.decode(errors="replace") for line in lines)
            if any("behind vllm-router" in line for line in log):
                ready.set()
        ready.set()  # the log ended: the supervisor exited, ready or not

    nursery.start_soon(read_log)
    with trio.move_on_after(300):
        await ready.wait()
    assert any("behind vllm-router" in line for line in log), "\n".join(log)
    replicas = [m.group(1) for line in log if (m := re.search(r"replica \d \(pid \d+\): (http://\S+)", line))]
    (router,) = [m.group(1) for line in log if (m := re.search(r"on (http://\S+)$", line))]
    return process, router, replicas, log


def replica_pid(log: list[str], url: str) -> int:
    """The process serving `url`, as the supervisor logged it."""
    (pid,) = [int(m.group(1)) for line in log if (m := re.search(rf"replica \d \(pid (\d+)\): {url}$", line))]
    return pid


async def ask_with_shared_prefix(router: str, model: str, count: int) -> None:
    client = openai.AsyncOpenAI(base_url=router + "/v1", api_key="none", max_retries=0)
    try:
        for i in range(count):  # one after another: each finds the prefix cached where it went
            await client.completions.create(model=model, prompt=f"{SHARED}Question {i}: what is {i} + {i}?",
                                            max_tokens=2, extra_body={"ignore_eos": True})
    finally:
        await client.close()


async def test_cache_aware_routing_keeps_a_shared_prefix_on_one_replica(tiny_text_model_dir):
    model = os.path.basename(tiny_text_model_dir)
    async with trio.open_nursery() as nursery:
        process, router, replicas, log = await start_replicated(nursery, tiny_text_model_dir, "cache_aware")
        try:
            assert len(replicas) == 2
            # the supervisor runs no model: it checked the model in a fork of its replicas' server
            with open(f"/proc/{process.pid}/maps") as maps:
                assert "libtorch" not in maps.read()
            await ask_with_shared_prefix(router, model, 8)
            hits = [await prefix_hits(url) for url in replicas]
            # All on one replica: it caches the prefix once, then hits it seven times.
            assert sorted(hits)[0] == 0 and sorted(hits)[1] > 0, hits
        finally:
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(60):
                await process.wait()
    # the whole log, to the last process's end: a replica that left a named semaphore behind
    # would have the resource tracker warn of it at shutdown
    assert not any("leaked" in line for line in log), "\n".join(log)


async def test_kv_aware_routing_follows_the_blocks_the_replicas_report(tiny_text_model_dir):
    """kv_aware learns from the replicas' KV-cache events, not from what it routed: a prefix
    cached on each replica by a request sent to it directly (the router never saw it) draws
    every later request that shares it to that replica, the first included: each finds its
    prefix cached. The prefixes go to the router in the other order than to the replicas, so
    that round robin would send the first of each to the wrong one."""
    model = os.path.basename(tiny_text_model_dir)
    prefixes = ["You are a careful assistant. " * 30, "Answer every question in French. " * 30]
    async with trio.open_nursery() as nursery:
        process, router, replicas, log = await start_replicated(nursery, tiny_text_model_dir, "kv_aware")
        try:
            for prefix, url in zip(prefixes, replicas):
                async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as direct:
                    await direct.completions.create(model=model, prompt=prefix + "Hello?", max_tokens=1)
            await trio.sleep(1)  # the events reach the router on their own
            served = [await requests_served(url) for url in replicas]
            async with openai.AsyncOpenAI(base_url=router + "/v1", api_key="none", max_retries=0) as client:
                for i in range(3):
                    for prefix in reversed(prefixes):
                        out = await client.completions.create(model=model, prompt=f"{prefix}Question {i}?",
                                                              max_tokens=1)
                        assert out.usage.prompt_tokens_details.cached_tokens >= 64, (i, prefix[:20])
            assert [await requests_served(url) - before for url, before in zip(replicas, served)] == [3, 3]
        finally:
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(60):
                await process.wait()


async def replica_models(url: str, headers: dict) -> list[str]:
    async with httpx.AsyncClient(base_url=url, headers=headers) as http:
        return [m["id"] for m in (await http.get("/v1/models")).json()["data"]]


async def replica_holding_a_request(replicas: list[str], headers: dict) -> str:
    """The replica with a live request, once there is one."""
    with trio.fail_after(30):
        while True:
            for url in replicas:
                async with httpx.AsyncClient(base_url=url, headers=headers) as http:
                    if (await http.get("/load")).json()["server_load"]:
                        return url
            await trio.sleep(0.05)


async def test_replicas_relay_admin_calls_serve_survive_a_death_and_stop_with_the_server(tiny_text_model_dir):
    """One deployment, round-robin, with --api-key and runtime adapters, in the order a life takes:
    no process's command line carries the key, the router reads the replicas' load (an open
    route, as /metrics), clients need the key, and the router lists the served model by its name.
    The router forwards an admin route to one replica, which relays it to the others: an adapter
    loaded or unloaded at the front door (or at either replica) is on both and listed once; an
    abort sent to the replica that does not hold the request ends it all the same. A proxy the
    environment names, which answers nothing, is bypassed by the supervisor's checks, the router
    and the relay alike. A client that leaves mid-stream frees the replica's blocks; a killed
    replica leaves the other serving; SIGTERM stops the router and every replica."""
    from lora_support import make_adapter

    model = os.path.basename(tiny_text_model_dir)
    adapter = make_adapter(tiny_text_model_dir, seed=1)
    key = "dp-secret-" + os.urandom(4).hex()
    auth = {"Authorization": f"Bearer {key}"}
    async with trio.open_nursery() as nursery:
        process, router, replicas, log = await start_replicated(
            nursery, tiny_text_model_dir, "round_robin", "--api-key", key, "--enable-lora", "--max-loras", "2",
            "--allow-runtime-lora", "--allowed-weights-dir", os.path.dirname(adapter),
            env={**os.environ, **{name: "http://127.0.0.1:9" for name in ("http_proxy", "HTTP_PROXY")}})
        children = started_by(process.pid)
        assert len(children) == 3, "two replicas and the router"
        everything = descendants(process.pid)  # with the fork server they came from
        for pid in everything:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert key.encode() not in f.read()
        async with httpx.AsyncClient(base_url=router, headers=auth) as http:  # power_of_two's: -1 when unreadable
            loads = (await http.get("/get_loads")).json()["workers"]
            models = (await http.get("/v1/models")).json()["data"]
        assert len(loads) == 2 and all(w["load"] >= 0 for w in loads), loads  # -1: unreadable
        assert [m["id"] for m in models] == [model]
        async with openai.AsyncOpenAI(base_url=router + "/v1", api_key="wrong", max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError):
                await wrong.completions.create(model=model, prompt="Hello", max_tokens=2)
        client = openai.AsyncOpenAI(base_url=router + "/v1", api_key=key, max_retries=0)
        chat = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=3)
        assert chat.choices[0].message.content is not None

        # Admin calls: adapters and aborts reach every replica.
        async with httpx.AsyncClient(base_url=router, headers=auth) as http:
            for name, where in (("front", router), ("direct", replicas[1])):
                async with httpx.AsyncClient(base_url=where, headers=auth) as at:
                    loaded = await at.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": adapter})
                assert loaded.status_code == 200, loaded.text
                for url in replicas:
                    assert name in await replica_models(url, auth), (name, url)
                assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]].count(name) == 1
            for _ in range(4):  # both replicas serve it
                out = await client.completions.create(model="front", prompt="Hello", max_tokens=2)
                assert out.usage.completion_tokens == 2
            assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "front"})).status_code == 200
            for url in replicas:
                assert "front" not in await replica_models(url, auth) and "direct" in await replica_models(url, auth)
            again = await http.post("/v1/load_lora_adapter", json={"lora_name": "direct", "lora_path": adapter})
            assert again.status_code == 400, "the replica that got it says it is loaded, and relays nothing"

            for where in ("other", "front"):
                stream = await client.completions.create(model=model, prompt="Once upon a time", max_tokens=240, n=8,
                                                         stream=True, extra_body={"ignore_eos": True})
                first = await stream.__anext__()
                holder = await replica_holding_a_request(replicas, auth)
                target = router if where == "front" else next(url for url in replicas if url != holder)
                async with httpx.AsyncClient(base_url=target, headers=auth) as at:
                    aborted = await at.post("/abort_request", json={"rid": first.id})
                assert aborted.status_code == 200 and aborted.json() == {"num_aborted": 1}, aborted.text
                reasons = [c.choices[0].finish_reason async for c in stream if c.choices]
                assert reasons[-1] == "abort", where
            missing = await http.post("/abort_request", json={"rid": "no-such-request"})
            assert missing.status_code == 404, missing.text

        # A client that leaves mid-stream: the replica serving it frees its blocks.
        stream = await client.completions.create(model=model, prompt="Once upon a time", max_tokens=200,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                break
        await stream.close()
        await logged(log, "abort (client gone)", 30)  # the router closed its upstream request: the replica aborted it
        for url in replicas:
            async with httpx.AsyncClient(base_url=url, headers=auth) as http:
                with trio.fail_after(30):
                    while (await http.get("/load")).json()["server_load"]:
                        await trio.sleep(0.05)

        # One replica killed: the other serves every request that follows.
        first_pid = replica_pid(log, replicas[0])
        assert first_pid in children
        os.kill(first_pid, signal.SIGKILL)
        for _ in range(4):
            out = await client.completions.create(model=model, prompt="Hello", max_tokens=2)
            assert out.usage.completion_tokens == 2
        await client.close()

        process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            await process.wait()
        with trio.fail_after(10):
            while any(map(live, everything)):
                await trio.sleep(0.05)


async def test_a_replica_elsewhere_joins_the_router_and_round_robin_spreads_a_prefix(tiny_text_model_dir):
    """--data-parallel-address: a `trillm serve` the supervisor did not start (here an
    in-process server, as one on another machine would be) is routed to beside the local two.
    Round-robin spreads requests sharing a prefix over all three, so each computes it once."""
    model = os.path.basename(tiny_text_model_dir)
    core = await trio.to_thread.run_sync(lambda: EngineCore(EngineArgs(model=tiny_text_model_dir, num_kv_blocks=64)))
    try:
        async with live_server(core) as remote, trio.open_nursery() as nursery:
            process, router, replicas, log = await start_replicated(
                nursery, tiny_text_model_dir, "round_robin", "--data-parallel-address", remote.url)
            try:
                async with httpx.AsyncClient(base_url=router) as http:
                    workers = {w["worker"] for w in (await http.get("/get_loads")).json()["workers"]}
                assert workers == {*replicas, remote.url}
                served_before = await requests_served(remote.url)
                await ask_with_shared_prefix(router, model, 9)
                assert await requests_served(remote.url) - served_before == 3, "round-robin gives the remote its turns"
                hits = [await prefix_hits(url) for url in (*replicas, remote.url)]
                assert all(h > 0 for h in hits), hits  # split: each replica computed the prefix once
            finally:
                process.send_signal(signal.SIGTERM)
                with trio.fail_after(60):
                    await process.wait()
    finally:
        await trio.to_thread.run_sync(core.close)


async def test_a_replica_that_cannot_start_fails_the_server_at_once_and_says_which(tmp_path):
    from gguf_support import write_untokenizable_gguf

    # its header passes the supervisor's checks; loading it in a replica finds its tokenizer cannot be built
    untokenizable = write_untokenizable_gguf(str(tmp_path / "untokenizable.gguf"))
    command = [sys.executable, "-m", "trillm", "serve", "--model", untokenizable, "--port", "0",
               "--data-parallel-size", "2"]
    with trio.fail_after(120):
        result = await trio.run_process(command, capture_stdout=True, stderr=subprocess.STDOUT, check=False)
    log = result.stdout.decode(errors="replace")
    assert result.returncode == 1, log
    assert re.search(r"replica \d exited while starting \(status 2\)", log), log
    assert "tokenizer cannot be built (KeyError)" in log  # the replica's own words


def test_a_start_that_never_answers_is_given_up_and_named(caplog):
    """A replica or router whose /health never answers (here nothing listens on its port) stops
    the supervisor's wait at its bound with one line naming it, rather than leaving the
    deployment unready and silent; the router's bound is a minute, not a replica's ten."""
    assert data_parallel.ROUTER_READY_TIMEOUT < data_parallel.READY_TIMEOUT
    with socket.create_server(("127.0.0.1", 0)) as closed:
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    router = type("Process", (), {"name": "the router", "exitcode": None})()
    with caplog.at_level(logging.ERROR, logger=data_parallel.__name__):
        assert not data_parallel._wait_ready([url], [router], [], timeout=0.5)
    said = [record.getMessage() for record in caplog.records]
    assert said == [f"the router ({url}) did not answer /health within 0.5 s: stopping"]
