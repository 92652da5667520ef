"""Many requests at once, and requests that end early: continuous batching seen from the clients,
and every way of ending a request (client gone, /abort_request, drain) freeing its KV blocks."""
import functools

import openai
import pytest
import trio
from http_support import frozen_engine, metric_value, settled_stats

PROMPT = "Once upon a time, in a small village nestled between two mountains,"
ENDLESS = {"ignore_eos": True}  # with a large max_tokens: runs until something stops it


async def wait_until_running(server, count: int) -> None:
    with trio.fail_after(60):
        while server.state.engine.stats().num_running < count:
            await trio.sleep(0.02)


async def test_ten_streams_progress_together(server):
    client = server.openai()
    events = []  # ("first" | "done", i), in the order the client saw them

    async def one(i: int) -> None:
        stream = await client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": f"Count from {i} to {i + 20}."}],
            max_tokens=12, temperature=0, stream=True, extra_body=ENDLESS,
        )
        seen_text = False
        async for chunk in stream:
            choice = chunk.choices[0]
            if choice.delta.content and not seen_text:
                seen_text = True
                events.append(("first", i))
            if choice.finish_reason is not None:
                assert choice.finish_reason == "length"
                events.append(("done", i))

    async with trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(one, i)
    firsts = [k for k, (kind, _) in enumerate(events) if kind == "first"]
    dones = [k for k, (kind, _) in enumerate(events) if kind == "done"]
    assert len(firsts) == len(dones) == 10
    assert max(firsts) < min(dones), f"a stream finished before all had started: {events}"


async def test_client_disconnect_aborts_the_request_and_frees_its_blocks(server):
    http, client = server.http(), server.openai()
    aborted = await metric_value(http, "trillm:request_success_total", finished_reason="abort")
    generated = await metric_value(http, "trillm:generation_tokens_total")
    stream = await client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=2000, stream=True, extra_body=ENDLESS
    )
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 3:
            break
    assert server.state.engine.stats().num_used_blocks > 0
    await stream.close()  # the client goes away mid-stream

    stats = await settled_stats(http)
    assert stats["kv_cache_usage"] == stats["num_used_blocks"] == stats["num_running"] == stats["num_waiting"] == 0
    assert await metric_value(http, "trillm:request_success_total", finished_reason="abort") == aborted + 1
    assert await metric_value(http, "trillm:generation_tokens_total") - generated < 2000
    out = await client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2)
    assert out.choices[0].finish_reason == "length", "the server still serves"


async def test_abort_request_ends_every_sample_of_a_live_stream_with_abort(server):
    http, client = server.http(), server.openai()
    stream = await client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=2000, n=2, stream=True, extra_body=ENDLESS,
        extra_headers={"X-Request-Id": "abort-me"},
    )
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 4:
            response = await http.post("/abort_request", json={"rid": "abort-me"})
            assert response.status_code == 200 and response.json() == {"num_aborted": 1}
    (response_id,) = {c.id for c in chunks}
    assert response_id.startswith("cmpl-"), "the response's id is the server's, never the client's"
    finals = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finals == {0: "abort", 1: "abort"}
    stats = await settled_stats(http)
    assert stats["kv_cache_usage"] == 0 and stats["num_running"] == 0
    gone = await http.post("/abort_request", json={"rid": "abort-me"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "rid"


async def test_abort_all_ends_whole_responses_with_abort(server):
    http, client = server.http(), server.openai()
    results = {}

    async def one(i: int) -> None:
        results[i] = await client.completions.create(
            model=server.model, prompt=f"{PROMPT} {i}", max_tokens=2000, extra_body=ENDLESS
        )

    async with trio.open_nursery() as nursery:
        for i in range(2):
            nursery.start_soon(one, i)
        await wait_until_running(server, 2)
        response = await http.post("/abort_request", json={"abort_all": True})
        assert response.json() == {"num_aborted": 2}
    for out in results.values():
        assert out.choices[0].finish_reason == "abort"
        assert 0 < out.usage.completion_tokens < 2000
    assert (await settled_stats(http))["num_used_blocks"] == 0


async def test_flush_cache_is_refused_while_a_request_runs(server):
    http, client = server.http(), server.openai()
    stream = await client.completions.create(
        model=server.model, prompt=PROMPT * 3, max_tokens=2000, stream=True, extra_body=ENDLESS,
        extra_headers={"X-Request-Id": "keep-busy"},
    )
    await anext(stream)
    refused = await http.post("/flush_cache")
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"
    await http.post("/abort_request", json={"rid": "keep-busy"})
    async for _ in stream:
        pass
    assert (await settled_stats(http))["num_cached_blocks"] > 0, "the prompt's blocks stay cached"
    assert (await http.post("/flush_cache")).status_code == 200
    assert (await http.get("/server_info")).json()["stats"]["num_cached_blocks"] == 0


async def test_drain_finishes_streams_with_abort_and_refuses_new_requests(server):
    http, client = server.http(), server.openai()
    stream = await client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=2000, stream=True, extra_body=ENDLESS
    )
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 2:
            await server.state.engine.drain(timeout=0)  # what SIGTERM does once the drain timeout is over
    assert chunks[-1].choices[0].finish_reason == "abort"
    assert (await http.get("/health")).status_code == 503
    with pytest.raises(openai.InternalServerError) as refused:
        await client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2)
    assert refused.value.status_code == 503
    assert (await settled_stats(http))["num_used_blocks"] == 0


async def test_a_burst_sharing_a_system_prompt_then_each_next_turn_hits_its_whole_conversation(server, core):
    """Four conversations with one long system prompt computed in the same step, then each one's
    next turn: it must find every full block of its own conversation in the prefix cache, the
    shared ones and its own (usage's cached tokens, through the native /generate)."""
    http = server.http()
    system = core.tokenizer.encode("You are a careful assistant. " * 12)
    turns = [system + core.tokenizer.encode(f"Conversation {k}: tell me about the number {k * 7}.") for k in range(4)]
    block_size = core.args.block_size
    outputs = [None] * len(turns)

    async def first_turn(k: int) -> None:
        response = await http.post("/generate", json={
            "input_ids": turns[k], "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
        outputs[k] = response.json()["output_ids"]

    async def live(count: int) -> None:
        with trio.fail_after(60):
            while server.state.engine.stats().num_live_requests < count:
                await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        with frozen_engine(core):
            # The engine is held in a step of another request while the four arrive, so the next
            # step admits them together and they compute the system prompt side by side.
            nursery.start_soon(functools.partial(http.post, "/generate", json={"input_ids": [5, 6]}))
            await live(1)
            for k in range(len(turns)):
                nursery.start_soon(first_turn, k)
            await live(1 + len(turns))
    for k, turn in enumerate(turns):
        conversation = turn + outputs[k]
        response = await http.post("/generate", json={
            "input_ids": conversation + core.tokenizer.encode(" And then?"), "sampling_params": {"max_new_tokens": 1}})
        # every block the first turn computed (all but its last, sampled token)
        assert response.json()["meta_info"]["cached_tokens"] == (len(conversation) - 1) // block_size * block_size


async def test_live_requests_may_share_a_client_id_and_abort_takes_either_id(server):
    """A proxy that retries with the same X-Request-Id, or two /generate calls with one rid: each
    runs. /abort_request with a response's id ends that request alone; with a client's id, every
    live request that carries it."""
    http, client = server.http(), server.openai()
    streams = [
        await client.completions.create(model=server.model, prompt=f"{PROMPT} {i}", max_tokens=2000, stream=True,
                                        extra_body=ENDLESS, extra_headers={"X-Request-Id": "retried"})
        for i in range(3)
    ]
    firsts = [await anext(aiter(s)) for s in streams]
    ids = [chunk.id for chunk in firsts]
    assert len(set(ids)) == 3 and "retried" not in ids
    assert streams[0].response.headers["X-Request-Id"] == "retried", "the client's id is echoed"
    assert (await http.post("/abort_request", json={"rid": ids[2]})).json() == {"num_aborted": 1}
    finals = [c.choices[0].finish_reason async for c in streams[2] if c.choices[0].finish_reason]
    assert finals == ["abort"]
    assert (await http.post("/abort_request", json={"rid": "retried"})).json() == {"num_aborted": 2}
    for stream in streams[:2]:
        finals = [c.choices[0].finish_reason async for c in stream if c.choices[0].finish_reason]
        assert finals == ["abort"]
    native = [
        await http.post("/generate", json={"text": PROMPT, "rid": "mine", "sampling_params": {"max_new_tokens": 2}})
        for _ in range(2)
    ]
    metas = [r.json()["meta_info"] for r in native]
    assert [m["completion_tokens"] for m in metas] == [2, 2] and metas[0]["id"] != metas[1]["id"] != "mine"
    stats = await settled_stats(http)
    assert stats["num_used_blocks"] == 0 and stats["num_running"] == 0


@functools.cache
def slow_long_core(model_dir: str):
    """The tiny model with room for long prompts, in small chunks."""
    from trillm.config import EngineArgs
    from trillm.engine.core import EngineCore

    return EngineCore(EngineArgs(model=model_dir, num_kv_blocks=64, max_num_batched_tokens=16))


async def test_a_prompt_retried_after_client_timeouts_resumes_where_it_was_cut(tiny_text_model_dir):
    """A client whose timeout is shorter than the prefill retries: the chunks each abandoned
    attempt computed stay in the prefix cache, so every attempt starts further on and one is
    answered, reporting the earlier attempts' work as cached tokens."""
    import time

    import httpx

    from http_support import live_server

    core = slow_long_core(tiny_text_model_dir)
    prompt = [1000 + (i * 7919) % 30000 for i in range(240)]  # 15 steps of 16 tokens
    core.runner.fault_hook = lambda sched: time.sleep(0.05)  # a slow device: ~0.75 s of prefill
    try:
        async with live_server(core) as server, httpx.AsyncClient(base_url=server.url) as client:
            body = {"model": server.model, "prompt": prompt, "max_tokens": 1}
            attempts = 0
            while True:
                attempts += 1
                assert attempts <= 12, "every attempt started over"
                try:
                    response = await client.post("/v1/completions", json=body, timeout=0.25)
                    break
                except httpx.TimeoutException:
                    await trio.sleep(0.1)  # the abort lands before the retry
            assert response.status_code == 200 and attempts > 1
            assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    finally:
        core.runner.fault_hook = None
