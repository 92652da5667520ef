"""`python -m trillm serve` as a user runs it: its own process, a free port, the real `openai`
client, and a SIGTERM while streams run (the drain lets one finish; a second signal aborts the
other), then a clean exit."""
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import trio

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT = 300  # seconds: the model loads first (not a speed check)


async def start_server(nursery: trio.Nursery, *flags: str) -> tuple[trio.Process, str, list[str]]:
    """The process, its URL (read from its log: it binds port 0), and its log lines so far and to come."""
    process = await nursery.start(
        lambda task_status: trio.run_process(
            [sys.executable, "-m", "trillm", "serve", "--port", "0", *flags],
            cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, check=False, task_status=task_status,
        )
    )
    log: list[str] = []
    url = trio.Event()
    found = []

    async def read_log():
        buffer = b""
        async for data in process.stderr:
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                log.append(line.decode(errors="replace"))
                match = re.search(r"Running on (http://[\d.]+:\d+)", log[-1])
                if match and not url.is_set():
                    found.append(match.group(1))
                    url.set()

    nursery.start_soon(read_log)
    with trio.fail_after(STARTUP_TIMEOUT):
        await url.wait()
    return process, found[0], log


async def test_serve_answers_then_drains_on_sigterm():
    async with trio.open_nursery() as nursery:
        process, url, log = await start_server(nursery, "--num-kv-blocks", "128", "--drain-timeout", "120")
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
