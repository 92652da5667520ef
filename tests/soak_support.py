"""The soak's driver and its leak checks, shared by tests/test_http_soak.py and benchmarks/soak.py
(a module, not a test file).

Each request is a streamed completion of random token ids with `ignore_eos`, `logprobs=0` (so every
token is its own chunk, and a chunk's logprobs count its tokens) and a usage chunk; every fourth is
a streamed /v1/responses request instead, judged by its typed events and its final usage. Its fate is
drawn in advance: run to the end, go away (close the stream after k chunks, or give up at a random
time, possibly before the response starts), or be aborted through /abort_request after k chunks.
What actually happened is judged from what the client saw: an abort that loses the race with the
request's last token is a completion, a client that meant to leave but got its final chunk first
completed too.
"""
from __future__ import annotations

import json
import random
import re
import threading
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field

import httpx
import openai
import trio
import trio.testing
from http_support import SETTLE_TIMEOUT, LiveServer, settled_stats

FATES = ("complete", "disconnect", "abort")


@dataclass
class SoakReport:
    num_requests: int = 0
    num_completed: int = 0
    num_disconnected: int = 0
    num_aborted: int = 0
    num_abort_races: int = 0  # /abort_request came after the last token: the request completed
    num_5xx: int = 0
    num_tokens: int = 0  # streamed to clients, over all requests
    num_preemptions: int = 0
    blocks_leaked: int | None = None  # set by check_no_leaks
    seconds: float = 0.0
    baseline_tasks: Counter = field(default_factory=Counter)
    baseline_threads: int = 0

    def summary(self) -> str:
        return (
            f"soak: {self.num_requests} requests in {self.seconds:.1f} s: {self.num_completed} completed, "
            f"{self.num_disconnected} disconnected, {self.num_aborted} aborted "
            f"({self.num_abort_races} aborts lost the race and completed); {self.num_tokens} tokens streamed, "
            f"{self.num_preemptions} preemptions, {self.num_5xx} 5xx, blocks leaked: {self.blocks_leaked}"
        )


def working_threads() -> list[threading.Thread]:
    """Every thread of this process but Trio's idle cached workers, which wait for a next job
    (and end after ten idle seconds, so a load leaves them behind for that long): a leaked thread
    is one still at a job (Trio names a worker after its job while it runs one), or of another
    kind."""
    return [t for t in threading.enumerate() if not re.fullmatch(r"Trio thread \d+", t.name)]


def task_names() -> Counter:
    """Every task of this Trio run, by name: the server's, its connections', the engine's."""
    names: Counter = Counter()

    def walk(task) -> None:
        names[task.name] += 1
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child)

    walk(trio.lowlevel.current_root_task())
    return names


async def run_soak(server: LiveServer, num_requests: int, seed: int, max_tokens: tuple[int, int] = (4, 40)) -> SoakReport:
    await trio.testing.wait_all_tasks_blocked()  # the server's listener tasks have all started
    report = SoakReport(num_requests=num_requests, baseline_tasks=task_names())
    rng = random.Random(seed)
    vocab = server.state.vocab_size
    client = server.openai(timeout=SETTLE_TIMEOUT * 5)
    http = server.http()
    await client.completions.create(model=server.model, prompt=[5, 6], max_tokens=1)  # the engine's thread exists
    report.baseline_threads = len(working_threads())
    preemptions = server.state.engine.stats().num_preemptions
    fates = [FATES[i % 3] for i in range(num_requests)]
    rng.shuffle(fates)
    started = trio.current_time()

    async def one_response(i: int, fate: str) -> None:
        """A streamed response: its final event says completed, incomplete (max_output_tokens) or,
        when aborted, cancelled; a client that leaves sees no final event."""
        words = " ".join(f"w{rng.randrange(1000)}" for _ in range(rng.randint(1, 4)))
        n = rng.randint(max_tokens[0], min(max_tokens[1], 24))  # the template takes ~40 tokens of a short context
        k = rng.randint(1, 6)  # events seen before leaving / aborting
        final, events, abort_status = None, 0, None
        body = {"model": server.model, "input": words, "max_output_tokens": n, "stream": True}
        async with http.stream("POST", "/v1/responses", json=body, headers={"X-Request-Id": f"soak-{i}"}) as response:
            report.num_5xx += response.status_code >= 500
            assert response.status_code == 200, (response.status_code, await response.aread())
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[len("data: "):])
                events += 1
                if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                    final = event["response"]
                if fate == "disconnect" and events == k and final is None:
                    break
                if fate == "abort" and events == k and abort_status is None:
                    abort_status = (await http.post("/abort_request", json={"rid": f"soak-{i}"})).status_code
                    report.num_5xx += abort_status >= 500
                    assert abort_status in (200, 404), abort_status
        if final is None:
            assert fate == "disconnect", f"response {i} ({fate}) ended without a final event"
            report.num_disconnected += 1
            return
        report.num_tokens += final["usage"]["output_tokens"]
        if final["status"] == "cancelled":
            assert abort_status == 200 and final["usage"]["output_tokens"] < n, (i, final["usage"], n)
            report.num_aborted += 1
            return
        assert final["status"] in ("completed", "incomplete"), final["status"]
        assert final["status"] == "completed" or final["usage"]["output_tokens"] == n
        report.num_completed += 1
        report.num_abort_races += fate == "abort"

    async def one(i: int, fate: str) -> None:
        if i % 4 == 3:
            return await one_response(i, fate)
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 24))]
        n = rng.randint(*max_tokens)
        k = rng.randint(0 if fate == "disconnect" else 1, n - 1)  # chunks seen before leaving / aborting
        give_up = trio.move_on_after(rng.uniform(0, 2.0)) if fate == "disconnect" and rng.random() < 0.25 else nullcontext()
        tokens, finishes, usage, chunks = 0, [], None, 0
        abort_status = None
        with give_up:
            try:
                stream = await client.completions.create(
                    model=server.model, prompt=prompt, max_tokens=n, stream=True, logprobs=0,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                    extra_headers={"X-Request-Id": f"soak-{i}"},
                )
            except openai.APIStatusError as exc:
                report.num_5xx += exc.status_code >= 500
                raise
            try:
                async for chunk in stream:
                    if chunk.usage is not None:
                        usage = chunk.usage
                    if not chunk.choices:
                        continue
                    choice = chunk.choices[0]
                    assert not finishes, "nothing after the final chunk but usage"
                    tokens += len(choice.logprobs.tokens) if choice.logprobs else 0
                    chunks += 1
                    if choice.finish_reason is not None:
                        finishes.append(choice.finish_reason)
                    if fate == "disconnect" and chunks == k and not finishes:
                        break
                    if fate == "abort" and chunks == k and abort_status is None:
                        abort_status = (await http.post("/abort_request", json={"rid": f"soak-{i}"})).status_code
                        report.num_5xx += abort_status >= 500
                        assert abort_status in (200, 404), abort_status
            finally:
                await stream.close()
        report.num_tokens += tokens
        if not finishes:
            assert fate == "disconnect", f"request {i} ({fate}) ended without a final chunk"
            report.num_disconnected += 1
            return
        assert usage is not None and usage.completion_tokens == tokens, (i, usage, tokens)
        if finishes == ["abort"]:
            assert abort_status == 200 and tokens < n, (i, abort_status, tokens, n)
            report.num_aborted += 1
            return
        assert finishes == ["length"] and tokens == n, f"request {i} ({fate}): {finishes}, {tokens} of {n} tokens"
        report.num_completed += 1
        report.num_abort_races += fate == "abort"

    async with trio.open_nursery() as nursery:
        for i, fate in enumerate(fates):
            nursery.start_soon(one, i, fate)
    report.seconds = trio.current_time() - started
    report.num_preemptions = server.state.engine.stats().num_preemptions - preemptions
    return report


async def check_no_leaks(server: LiveServer, report: SoakReport) -> None:
    """With every client gone: no KV block in use, empty engine tables, the Trio tasks of before
    the soak and no more working threads (working_threads) than after its first request."""
    for client in server.clients:
        await (client.close() if isinstance(client, openai.AsyncOpenAI) else client.aclose())
    server.clients.clear()
    async with httpx.AsyncClient(base_url=server.url, timeout=SETTLE_TIMEOUT) as http:
        stats = await settled_stats(http)
    report.blocks_leaked = stats["num_used_blocks"]
    assert stats["num_used_blocks"] == stats["num_running"] == stats["num_waiting"] == 0, stats
    engine, core = server.state.engine, server.state.engine.core
    live = engine.live
    assert not len(live) and not engine._link.commands and live.unfinished_members == 0
    assert not core.requests and not core.has_unfinished()
    with trio.move_on_after(SETTLE_TIMEOUT):
        while task_names() != report.baseline_tasks or len(working_threads()) > report.baseline_threads:
            await trio.sleep(0.05)
    extra = task_names() - report.baseline_tasks
    assert not extra, f"tasks left behind: {extra}"
    assert len(working_threads()) <= report.baseline_threads, working_threads()
