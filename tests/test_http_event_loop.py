"""One request's size must not freeze everyone else: while requests whose work grows with them
are read, validated, tokenised and rendered (a prompt of megabytes, 10,000 bad words, a template
over thousands of messages, a list of a million prompts, deep nesting), a neighbour's stream keeps
getting tokens and /health keeps answering, each within a bound (the 1 s a Kubernetes probe
waits), because that work runs in worker threads of its own, and lists are refused by their
length before any item is read. The bound is a behaviour (a probe that fails restarts the pod),
not a speed figure: unbounded, these requests held the loop for seconds."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
import trio

from http_support import live_server, tiny_core
from process_support import start_server

BOUND_S = 1.0


@pytest.fixture(scope="session")
def core(tiny_text_model_dir):
    return tiny_core(tiny_text_model_dir)


def heavy_requests(model: str) -> list[tuple[str, bytes, int]]:
    """(path, JSON body, the status it must get)."""
    text = "All work and no play makes a dull day. " * 75_000  # ~3 MB
    words = [f"w{i}x" for i in range(10_000)]
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "lorem ipsum " * 30}
                for i in range(4_001)]
    cases = [
        ("/tokenize", {"model": model, "prompt": text}, 200),
        ("/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 1, "bad_words": words}, 200),
        ("/tokenize", {"model": model, "messages": messages}, 200),
        ("/v1/completions", {"model": model, "prompt": ["a"] * 1_300_000, "max_tokens": 1}, 400),
        ("/v1/embeddings", {"model": model, "input": text}, 400),
    ]
    return [(path, json.dumps(body).encode(), status) for path, body, status in cases] + [
        ("/v1/completions", b"[" * 200_000 + b"]" * 200_000, 400)]


@pytest.mark.quiet
async def test_heavy_requests_never_stall_a_neighbour_stream_or_health(core):
    async with live_server(core) as server:
        http = server.http()
        stats = {"health": [], "gaps": []}
        heavy_done = trio.Event()

        async def neighbour():
            body = {"model": server.model, "prompt": "Once", "max_tokens": 80, "ignore_eos": True, "stream": True}
            while not heavy_done.is_set():
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    last = trio.current_time()
                    async for _ in response.aiter_lines():
                        now = trio.current_time()
                        if not heavy_done.is_set():
                            stats["gaps"].append(now - last)
                        last = now

        async def probe():
            async with httpx.AsyncClient(base_url=server.url, timeout=BOUND_S) as prober:
                while not heavy_done.is_set():
                    start = trio.current_time()
                    response = await prober.get("/health")
                    stats["health"].append((response.status_code, trio.current_time() - start))
                    await trio.sleep(0.05)

        async def heavy():
            await trio.sleep(0.3)  # the neighbour is streaming
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                async with trio.open_nursery() as nursery:  # all at once: the threads' bound is reached too
                    for path, body, status in heavy_requests(server.model):
                        nursery.start_soon(one, client, path, body, status)
            heavy_done.set()

        async def one(client, path, body, status):
            response = await client.post(path, content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == status, (path, response.text[:200])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(neighbour)
            nursery.start_soon(probe)
            nursery.start_soon(heavy)
        assert stats["health"] and all(code == 200 for code, _ in stats["health"])
        slowest_probe = max(t for _, t in stats["health"])
        slowest_token = max(stats["gaps"])
        print(f"{len(stats['health'])} probes, slowest {slowest_probe:.3f} s; "
              f"{len(stats['gaps'])} neighbour tokens, longest gap {slowest_token:.3f} s")
        assert slowest_probe < BOUND_S and slowest_token < BOUND_S


async def test_what_the_server_loaded_is_out_of_the_collectors_walks(server):
    """A full collection walks every tracked object, holding the interpreter lock, and on the heap
    a loaded model leaves it stalled the loop for about a second (seen in the fuzz run's health
    probes). Once serving, what startup loaded is frozen, so a collection walks only what came
    since: far fewer objects than were frozen."""
    import gc

    assert (await server.http().get("/health")).status_code == 200
    assert gc.get_freeze_count() > 10 * len(gc.get_objects())


def test_start_up_runs_no_full_collection_until_the_heap_is_frozen():
    """Importing what a server loads (torch, transformers) sets off full collections, each walking
    everything imported so far: with the collector paused, as the command line's `serve` pauses
    it, none runs, and freezing the heap collects once and turns the collector back on; a
    start-up that stops before serving leaves it on too."""
    script = """
import gc
from trillm.heap import collector_paused, freeze_heap

with collector_paused():
    import torch, transformers.models.gemma
    full = gc.get_stats()[2]["collections"]
    freeze_heap()
    print(full, gc.get_stats()[2]["collections"], gc.isenabled())
with collector_paused():
    pass  # a start-up that stops before serving
print(gc.isenabled())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1", "True", "True"]


async def test_the_collection_before_serving_walks_what_loading_made_not_the_imports():
    """`trillm serve` freezes what its imports made (a few hundred thousand objects) before it
    loads the model, so the one collection before it serves walks only what came since (what
    the load imported besides, with the model's config class, and the app), fewer than were
    frozen: its walk of the whole imported heap was a quarter of a second of every start-up."""
    wrapper = """
import gc, sys

def tell(phase, info):
    if phase == "start":
        print("collection", info["generation"], len(gc.get_objects()), gc.get_freeze_count(), flush=True)

gc.callbacks.append(tell)
from trillm.launch.cli import main

main(sys.argv[1:])
"""
    command = [sys.executable, "-c", wrapper, "serve", "--port", "0", "--num-kv-blocks", "64"]
    async with trio.open_nursery() as nursery:
        process, url, log = await start_server(nursery, command)
        async with httpx.AsyncClient(base_url=url) as http:
            assert (await http.get("/health")).status_code == 200
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            await process.wait()
    loading = next(i for i, line in enumerate(log) if "trillm.launch.serve" in line and " loading " in line)
    walks = [line.split()[1:] for line in log[loading:] if line.startswith("collection ")]
    assert walks, "\n".join(log)
    generation, objects, frozen = walks[0]  # freeze_heap's: the collector is paused until then
    assert generation == "2" and int(objects) < int(frozen), f"it walked {objects} objects, {frozen} frozen"


def test_a_frozen_heap_leaves_nothing_to_leak_at_exit():
    """The interpreter's last collections skip frozen objects, so cycles among them outlive their
    extension modules at exit, and Triton's bindings report them as leaks: what a server froze
    goes back to the collector at exit."""
    script = """
import trillm.kernels.activation_triton  # Triton's bindings
from trillm.heap import freeze_heap

freeze_heap()
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr, done.stderr
