"""The server as a user runs it, in its own process on a free port, with the real `openai` client:
`python -m trillm serve` through a SIGTERM while streams run (the drain lets one finish; a second
signal aborts the other), and Hypercorn's own launch of the app factory, configured by TRILLM_*."""
import json
import os
import re
import signal
import sys

import httpx
import openai
import trio
from hypothesis import given
from hypothesis import strategies as st
from process_support import descendants, live, start_server, started_by


async def test_serve_answers_then_drains_on_sigterm():
    async with trio.open_nursery() as nursery:
        command = [sys.executable, "-m", "trillm", "serve", "--port", "0", "--num-kv-blocks", "128"]
        command += ["--drain-timeout", "120"]
        process, url, log = await start_server(nursery, command)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        model = (await client.models.list()).data[0].id
        answer = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5, temperature=0
        )
        assert answer.choices[0].message.content and answer.usage.completion_tokens <= 5

        finishes = {}
        started = {"short": trio.Event(), "long": trio.Event()}

        async def stream(name: str, max_tokens: int) -> None:
            chunks = await client.completions.create(
                model=model, prompt=f"A {name} story:", max_tokens=max_tokens, stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in chunks:
                started[name].set()
                if chunk.choices[0].finish_reason:
                    finishes[name] = chunk.choices[0].finish_reason

        async with trio.open_nursery() as streams:
            streams.start_soon(stream, "short", 6)
            streams.start_soon(stream, "long", 4000)
            await started["short"].wait()
            await started["long"].wait()
            process.send_signal(signal.SIGTERM)
            async with httpx.AsyncClient(base_url=url) as http:
                with trio.fail_after(60):
                    while (await http.get("/health")).status_code != 503:
                        await trio.sleep(0.05)
                refused = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert refused.status_code == 503, "draining: no new requests"
            with trio.fail_after(120):
                while "short" not in finishes:
                    await trio.sleep(0.05)
            assert finishes == {"short": "length"}, "the drain lets running requests finish"
            process.send_signal(signal.SIGTERM)  # a second signal cuts the drain short
        assert finishes == {"short": "length", "long": "abort"}
        await client.close()
        with trio.fail_after(60):
            assert await process.wait() == 0, "\n".join(log)


async def test_hypercorn_launches_the_app_factory_from_the_environment():
    env = {**os.environ, "TRILLM_NUM_KV_BLOCKS": "64", "TRILLM_SERVED_MODEL_NAME": "smol", "TRILLM_API_KEY": "sesame"}
    command = [
        sys.executable, "-m", "hypercorn", "--worker-class", "trio", "--bind", "127.0.0.1:0",
        "trillm.http.app:create_app()",
    ]
    async with trio.open_nursery() as nursery:
        process, url, log = await start_server(nursery, command, env)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        assert [m.id for m in (await client.models.list()).data] == ["smol"]
        out = await client.completions.create(model="smol", prompt="Hello", max_tokens=3)
        assert out.usage.completion_tokens == 3
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer sesame"}) as http:
            assert (await http.get("/server_info")).json()["settings"]["engine"]["num_kv_blocks"] == 64
        await client.close()
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            assert await process.wait() == 0, "\n".join(log)


async def test_sigterm_under_load_ends_every_stream_with_a_final_chunk_and_exits(tiny_text_model_dir):
    """Forty completion streams of random lengths and eight streamed responses when SIGTERM
    arrives: those that finish within the drain end with "length" (a response: completed or
    incomplete), the rest with "abort" (a response: cancelled); every one gets its final chunk or
    event, and the process exits 0. Its log names the request on every line about one."""
    async with trio.open_nursery() as nursery:
        command = [sys.executable, "-m", "trillm", "serve", "--port", "0", "--model", tiny_text_model_dir]
        command += ["--drain-timeout", "1"]
        process, url, log = await start_server(nursery, command)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        model = (await client.models.list()).data[0].id
        finishes, started = {}, []
        all_started = trio.Event()

        def note_started(i: int) -> None:
            """Whichever stream starts last, completion or response, sets the event (each kind
            checking its own count could miss it, and the test would wait forever)."""
            if i not in started:
                started.append(i)
                if len(started) == 48:
                    all_started.set()

        async def stream(i: int) -> None:
            chunks = await client.completions.create(
                model=model, prompt=[5 + i, 6, 7],
                max_tokens=10 + 5 * i, stream=True, logprobs=0, extra_body={"ignore_eos": True},
                extra_headers={"X-Request-Id": f"term-{i}"},
            )
            async for chunk in chunks:
                note_started(i)
                if chunk.choices[0].finish_reason:
                    finishes[i] = chunk.choices[0].finish_reason

        async def response_stream(i: int) -> None:
            body = {"model": model, "input": f"Word {i}", "max_output_tokens": 100 + 10 * (i - 40), "stream": True}
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                async with http.stream("POST", "/v1/responses", json=body,
                                       headers={"X-Request-Id": f"term-{i}"}) as response:
                    assert response.status_code == 200, await response.aread()
                    async for line in response.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        event = json.loads(line[len("data: "):])
                        note_started(i)
                        if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                            finishes[i] = event["response"]["status"]

        async with trio.open_nursery() as streams:
            for i in range(40):
                streams.start_soon(stream, i)
            for i in range(40, 48):
                streams.start_soon(response_stream, i)
            await all_started.wait()
            process.send_signal(signal.SIGTERM)
        assert len(finishes) == 48, finishes
        assert {finishes[i] for i in range(40)} <= {"length", "abort"}, finishes
        responses = {finishes[i] for i in range(40, 48)}
        assert "cancelled" in responses and responses <= {"completed", "incomplete", "cancelled"}, finishes
        await client.close()
        with trio.fail_after(60):
            assert await process.wait() == 0, "\n".join(log)
    ended = [line for line in log if "ended after" in line]
    assert len(ended) == 48, ended
    assert all(re.search(r"\[term-\d+\] (cmpl-|resp_)[0-9a-f]{32} ended after", line) for line in ended), ended


async def test_a_tensor_parallel_server_stops_every_rank_on_sigterm(tiny_text_model_dir):
    command = [sys.executable, "-m", "trillm", "serve", "--model", tiny_text_model_dir, "--port", "0",
               "--num-kv-blocks", "64", "--tensor-parallel-size", "2"]
    async with trio.open_nursery() as nursery:
        process, url, log = await start_server(nursery, command)
        assert len(started_by(process.pid)) == 1, "rank 0 starts the one other rank"
        workers = descendants(process.pid)  # the rank, and multiprocessing's fork server it came from
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        out = await client.completions.create(model=os.path.basename(tiny_text_model_dir), prompt="Hello",
                                              max_tokens=4, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
        await client.close()
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            assert await process.wait() == 0, "\n".join(log)
        with trio.fail_after(10):
            while any(map(live, workers)):
                await trio.sleep(0.05)


@given(start=st.floats(0, 1e6), drain_timeout=st.floats(0.01, 3600), drained=st.floats(0, 1))
def test_the_shutdown_budget_ends_within_the_drain_timeout(start, drain_timeout, drained):
    """Running requests get most of the drain timeout; the last chunks' grace, wherever the drain
    ended, leaves half the reserve for closing, so the process is gone by the deadline."""
    from trillm.launch.serve import FLUSH_GRACE, STOP_RESERVE, ShutdownBudget

    budget = ShutdownBudget.starting(start, drain_timeout)
    assert budget.deadline == start + drain_timeout
    assert start + drain_timeout / 2 - 1e-6 <= budget.finish_by <= budget.deadline
    assert budget.deadline - budget.finish_by <= STOP_RESERVE + 1e-6
    flushing_from = start + drained * (budget.finish_by - start)  # the drain ended here (all finished, or cut)
    grace = budget.flush_grace(flushing_from)
    assert 0 <= grace <= FLUSH_GRACE
    assert flushing_from + grace <= budget.deadline - (budget.deadline - budget.finish_by) / 2 + 1e-6
