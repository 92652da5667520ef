"""Overload: more requests than --max-waiting allows. The surplus is refused at once with a 429 and
an OpenAI error body, the admitted ones all finish, and what the server holds stays bounded.

"At once" is made exact by freezing the engine inside its first step (the runner's fault hook
blocks until the test lets go): every refusal arrives while no request can have made progress,
so none of them waited for the engine.
"""
import threading

import openai
import pytest
import trio
from http_support import SETTLE_TIMEOUT, frozen_engine, live_server, settled_stats, tiny_core

NUM_REQUESTS = 120
MAX_WAITING = 16
MAX_TOKENS = 8


@pytest.fixture(scope="session")
def core(tiny_text_model_dir):
    return tiny_core(tiny_text_model_dir)


async def test_requests_over_max_waiting_get_429_at_once_and_admitted_ones_finish(core):
    gate = threading.Event()
    core.runner.fault_hook = lambda sched: gate.wait()
    try:
        async with live_server(core, max_waiting=MAX_WAITING) as server:
            client, http = server.openai(timeout=SETTLE_TIMEOUT), server.http()
            refused, finished = [], []

            async def one(i: int) -> None:
                try:
                    out = await client.completions.create(
                        model=server.model, prompt=[10 + i, 11, 12], max_tokens=MAX_TOKENS,
                        extra_body={"ignore_eos": True},
                    )
                except openai.RateLimitError as exc:
                    assert gate.is_set() is False, "a refusal waited for the engine"
                    refused.append(exc)
                    return
                finished.append(out)

            async with trio.open_nursery() as nursery:
                for i in range(NUM_REQUESTS):
                    nursery.start_soon(one, i)
                with trio.fail_after(SETTLE_TIMEOUT):  # each request is refused or held, none can finish
                    while len(refused) + server.state.engine.stats().num_live_requests < NUM_REQUESTS:
                        await trio.sleep(0.01)
                frozen = server.state.engine.stats()
                assert (await http.get("/health")).status_code == 200, "overload is not ill health"
                gate.set()

            held = NUM_REQUESTS - len(refused)
            assert held <= frozen.num_running + MAX_WAITING, "live requests are bounded by the limits"
            assert len(refused) >= NUM_REQUESTS - frozen.num_running - MAX_WAITING > 0
            for exc in refused:
                error = exc.body
                assert exc.status_code == 429 and error["type"] == "rate_limit_error" and "retry" in error["message"]
            assert len(finished) == held
            assert all(o.choices[0].finish_reason == "length" and o.usage.completion_tokens == MAX_TOKENS for o in finished)
            stats = await settled_stats(http)
            assert stats["num_used_blocks"] == 0 and stats["num_live_requests"] == 0
            print(f"overload: {NUM_REQUESTS} requests, {len(refused)} refused with 429, {held} admitted and finished")
    finally:
        gate.set()
        core.runner.fault_hook = None


async def test_the_limit_counts_a_whole_group(core):
    """A list of prompts times n is one request but many engine requests: the limit counts them
    all, so one request cannot walk around it; one larger than the limit alone is a 400."""
    async with live_server(core, max_waiting=MAX_WAITING) as server:
        client, http = server.openai(timeout=SETTLE_TIMEOUT), server.http()
        too_many = await http.post("/v1/completions", json={"prompt": [[5, 6]] * 5, "n": 4, "max_tokens": 2})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
        assert f"at most {MAX_WAITING}" in too_many.json()["error"]["message"]
        too_many = await http.post("/v1/completions", json={"prompt": [[5, 6]] * (MAX_WAITING + 1), "max_tokens": 2})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"
        too_many = await http.post("/generate", json={"input_ids": [[5, 6]] * (MAX_WAITING + 1)})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"
        assert (await http.post("/v1/completions", json={"prompt": ["a"] * 2049})).status_code == 400
        too_many = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "n": MAX_WAITING + 1, "max_tokens": 2})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
        results = []

        async def fill() -> None:
            results.append(await client.completions.create(
                model=server.model, prompt=[[5, 6]] * 6, n=2, max_tokens=2, extra_body={"ignore_eos": True}))

        async with trio.open_nursery() as nursery:
            with frozen_engine(core):
                nursery.start_soon(fill)
                with trio.fail_after(SETTLE_TIMEOUT):
                    while server.state.engine.stats().num_live_requests < 1:
                        await trio.sleep(0.01)
                # 12 engine requests held, 16 allowed: a group of 5 does not fit, one of 4 would.
                spec = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}
                compiled_before = len(core.grammars._cache)
                with pytest.raises(openai.RateLimitError):
                    await client.completions.create(model=server.model, prompt=[[7, 8]] * 5, max_tokens=2,
                                                    extra_body={"response_format": spec})
                assert len(core.grammars._cache) == compiled_before, "a refused group compiled nothing"
                assert server.state.engine.stats().num_live_requests == 1
        assert results[0].usage.completion_tokens == 24
        stats = await settled_stats(http)
        assert stats["num_used_blocks"] == 0


async def test_a_refused_chat_group_names_messages(core):
    """The engine speaks of a prompt; a chat client sent messages, so the 400 names those."""
    async with live_server(core, max_waiting=0) as server:
        chat = await server.http().post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"


async def test_a_request_that_can_never_run_is_refused_while_a_step_is_held(core):
    """What the core refuses of a request by itself (prompt + max_tokens past the context, a token
    id outside the vocabulary, a prompt as long as the context) is a 400 naming the field while
    the engine is held inside a step: it is checked before it waits for one, not when the step in
    flight ends (at a large model's prefill, seconds)."""
    async with live_server(core) as server:
        client, state = server.openai(), server.state
        with frozen_engine(core):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: client.completions.create(
                    model=server.model, prompt=[10, 11, 12], max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}))
                with trio.fail_after(SETTLE_TIMEOUT):
                    while not state.engine._link.stepping:
                        await trio.sleep(0.01)
                refusals = [
                    ({"prompt": [10, 11], "max_tokens": state.max_model_len}, "max_tokens"),
                    ({"prompt": [10, state.vocab_size], "max_tokens": 1}, "prompt"),
                    ({"prompt": [10] * state.max_model_len, "max_tokens": 1}, "prompt"),
                ]
                with trio.fail_after(SETTLE_TIMEOUT):  # without the check up front: held until the gate opens
                    for body, param in refusals:
                        with pytest.raises(openai.BadRequestError) as refused:
                            await client.completions.create(model=server.model, **body)
                        assert refused.value.body["param"] == param, refused.value.body
                assert state.engine._link.stepping, "the step is still held"
                nursery.cancel_scope.cancel()
