"""Several HTTP fronts on one engine (`--api-server-count`, trillm/launch/fronts.py): each front's
requests come back to it; what the fronts share lives in the engine's process (an abort by a
client's name, the LoRA adapters, the queue's gauges) or in files they all write (the metrics);
`trillm serve --api-server-count 2` serves one port from two processes, drains both on SIGTERM,
and stops whole when a front dies."""
import fcntl
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from multiprocessing.reduction import ForkingPickler

import httpx
import openai
import pytest
import trio

from http_support import EXACT, SETTLE_TIMEOUT, finish_of_stream, greedy_ids, live_server, metric_value
from lora_support import make_adapter
from process_support import live, logged, start_server, started_by
from trillm import SamplingParams
from trillm.config import EngineArgs
from trillm.engine.api import AsyncEngine, EngineLink, EngineProcess, RequestGroup


async def test_two_fronts_share_one_engine(tiny_text_model_dir):
    adapter = make_adapter(tiny_text_model_dir, seed=3)
    args = EngineArgs(model=tiny_text_model_dir, num_kv_blocks=64, max_model_len=256, enable_lora=True, max_loras=2,
                      **EXACT)
    settings = dict(allow_runtime_lora=True, allowed_weights_dir=tempfile.gettempdir())
    with EngineProcess(args, fronts=2) as first, EngineLink(first.front_specs()[0]) as second:
        # Spawning a front writes its pickled arguments into a pipe; where they outgrow it (the
        # tokenizer did), the start blocks until the child has imported all that unpickling them
        # needs, and the fronts started one after another.
        reader, writer = os.pipe()
        try:
            capacity = fcntl.fcntl(writer, fcntl.F_GETPIPE_SZ)
        finally:
            os.close(reader)
            os.close(writer)
        assert len(ForkingPickler.dumps(first.front_specs()[0])) < capacity
        async with live_server(first, **settings) as one, live_server(second, **settings) as two:
            clients = one.openai(), two.openai()
            # each front's requests come back to it, at once and alike
            answers = {}

            async def ask(k: int) -> None:
                answers[k] = await greedy_ids(clients[k % 2], one.model, prompt=[10 + k % 3, 11], max_tokens=12)

            async with trio.open_nursery() as nursery:
                for k in range(12):
                    nursery.start_soon(ask, k)
            assert all(answers[k] == answers[k % 3] for k in answers), "the same prompt, the same tokens, either front"

            # a client's name aborts its request whichever front it reached
            async def abort():
                return await one.http().post("/abort_request", json={"rid": "shared-name"})

            finish, aborted = await finish_of_stream(clients[1], two.model, 80, abort,
                                                     extra_headers={"X-Request-Id": "shared-name"})
            assert aborted.status_code == 200 and aborted.json() == {"num_aborted": 1}, aborted.text
            assert finish == "abort"
            unknown = await one.http().post("/abort_request", json={"rid": "shared-name"})
            assert unknown.status_code == 404, "nothing of that name runs on any front now"

            # an adapter loaded through one front is served through the other
            loaded = await one.http().post("/v1/load_lora_adapter", json={"lora_name": "three", "lora_path": adapter})
            assert loaded.status_code == 200, loaded.text
            with trio.fail_after(SETTLE_TIMEOUT):
                while "three" not in {m.id for m in (await clients[1].models.list()).data}:
                    await trio.sleep(0.02)
            assert (await greedy_ids(clients[1], "three", max_tokens=8)) == (await greedy_ids(clients[0], "three",
                                                                                              max_tokens=8))
            assert (await greedy_ids(clients[0], "three", max_tokens=8)) != (await greedy_ids(clients[0], one.model,
                                                                                              max_tokens=8))
            # a stored response is found, chained from, cancelled and deleted through either front
            opening = await clients[0].responses.create(model=one.model, input="Hello", max_output_tokens=4,
                                                        temperature=0)
            assert (await clients[1].responses.retrieve(opening.id)).output_text == opening.output_text
            chained = await clients[1].responses.create(model=one.model, previous_response_id=opening.id,
                                                        input="Again", max_output_tokens=4, temperature=0)
            assert chained.usage.input_tokens > opening.usage.input_tokens, "the first turn is in its prompt"
            long = {"model": one.model, "input": "Count.", "max_output_tokens": 200, "background": True}

            async def held(ask):
                """`ask()`'s answer, asked while the engine's process is stopped: the response it
                names runs until the engine applies what `ask` sent."""
                answer = []

                async def run() -> None:
                    answer.append(await ask())

                os.kill(first.process.pid, signal.SIGSTOP)
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(run)
                        await trio.sleep(0.2)  # asked: its command waits for the engine
                        os.kill(first.process.pid, signal.SIGCONT)
                finally:
                    os.kill(first.process.pid, signal.SIGCONT)
                return answer[0]

            created = (await one.http().post("/v1/responses", json=long)).json()
            cancelled = await held(lambda: two.http().post(f"/v1/responses/{created['id']}/cancel"))
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
            assert (await clients[0].responses.retrieve(created["id"])).status == "cancelled"
            created = (await one.http().post("/v1/responses", json=long)).json()
            deleted = await held(lambda: two.http().delete(f"/v1/responses/{created['id']}"))
            assert deleted.status_code == 200, deleted.text
            with trio.fail_after(SETTLE_TIMEOUT):
                while (await one.http().get("/server_info")).json()["stats"]["num_live_requests"]:
                    await trio.sleep(0.02)
            for http in (one.http(), two.http()):
                assert (await http.get(f"/v1/responses/{created['id']}")).status_code == 404, "deleted stays deleted"

            unloaded = await two.http().post("/v1/unload_lora_adapter", json={"lora_name": "three"})
            assert unloaded.status_code == 200, unloaded.text
            with trio.fail_after(SETTLE_TIMEOUT):
                while "three" in {m.id for m in (await clients[0].models.list()).data}:
                    await trio.sleep(0.02)


async def test_a_front_made_before_the_engine_links_to_it_loses_no_request(tiny_text_model_dir):
    """The engine's process connects to a front's sockets some time after the front binds them
    (within a tenth of a second while it runs; here it is stopped for a second). A command sent
    before found no peer and was dropped, and its request waited for ever: on a loaded machine
    the test above hung so. A front now serves once the engine has linked to it, and the
    request it takes at once is answered."""
    args = EngineArgs(model=tiny_text_model_dir, num_kv_blocks=64, max_model_len=256)
    with EngineProcess(args, fronts=2) as first:
        os.kill(first.process.pid, signal.SIGSTOP)
        resume = threading.Timer(1.0, os.kill, (first.process.pid, signal.SIGCONT))
        resume.start()
        try:
            with EngineLink(first.front_specs()[0]) as second:
                engine = AsyncEngine(second, max_waiting=4)
                async with trio.open_nursery() as nursery:
                    await nursery.start(engine.run)
                    with trio.fail_after(SETTLE_TIMEOUT):
                        stream = await engine.add(RequestGroup("first", [([10, 11], SamplingParams(max_tokens=3))]))
                        outputs = [out async for _, out in stream]
                    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
                    await engine.aclose()
        finally:
            resume.cancel()
            os.kill(first.process.pid, signal.SIGCONT)


def _fronts(log: list[str]) -> dict[int, int]:
    """Each front other than the first, by index: its process, as it logged it."""
    return {int(m[1]): int(m[2]) for line in log if (m := re.search(r"front (\d+) serves in process (\d+)", line))}


@pytest.mark.parametrize("fronts,moment", [(1, "loading"), (2, "2 HTTP fronts serve the port")])
async def test_a_signal_while_the_server_starts_stops_it_as_any_signal_does(tiny_text_model_dir, fronts, moment):
    """SIGINT while the model loads, or in the moment after the other fronts serve and before the
    first serves itself: the start stops where it is, or the server drains at once, and exits 0,
    every front with it. It raised a KeyboardInterrupt wherever the first front's task next
    resumed: after the fronts' start, it left them untold and its exit waited for them for ever
    (multiprocessing's exit joins its children, and fronts ignore SIGTERM)."""
    command = [sys.executable, "-m", "trillm", "serve", "--api-server-count", str(fronts), "--port", "0", "--model",
               tiny_text_model_dir, "--num-kv-blocks", "64", "--drain-timeout", "120"]
    async with trio.open_nursery() as nursery:
        process = await nursery.start(lambda task_status: trio.run_process(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False, task_status=task_status))
        log = []

        async def read_log():
            async for data in process.stdout:
                log.extend(data.decode(errors="replace").splitlines())

        nursery.start_soon(read_log)
        await logged(log, moment)
        processes = started_by(process.pid)
        process.send_signal(signal.SIGINT)
        with trio.move_on_after(SETTLE_TIMEOUT):  # not the drain timeout
            await process.wait()
            while any(map(live, processes)):
                await trio.sleep(0.05)
        assert process.returncode == 0 and not any(map(live, processes)), "\n".join(log[-30:])
        stopped = ("SIGINT while starting: stopping", "SIGINT: draining")
        assert any(said in line for line in log for said in stopped), "\n".join(log[-30:])
        assert not any("Traceback" in line for line in log)


async def test_three_fronts_serve_one_port_and_one_that_dies_stops_the_server_after_a_drain(tiny_text_model_dir):
    command = [sys.executable, "-m", "trillm", "serve", "--api-server-count", "3", "--port", "0", "--model",
               tiny_text_model_dir, "--num-kv-blocks", "64", "--drain-timeout", "60"]
    async with trio.open_nursery() as nursery:
        process, url, log = await start_server(nursery, command)
        await logged(log, "3 HTTP fronts serve the port")  # the first front says so once every front serves
        fronts = _fronts(log)
        assert set(fronts) == {1, 2}
        processes = started_by(process.pid)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        model = (await client.models.list()).data[0].id
        answers = []

        async def ask() -> None:
            # a connection of its own each: the kernel hands each to one front
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as own:
                answers.append(await greedy_ids(own, model, max_tokens=6))

        async with trio.open_nursery() as requests:
            for _ in range(16):
                requests.start_soon(ask)
        assert len({tuple(a) for a in answers}) == 1 and len(answers) == 16
        assert any(re.search(r"\[front [12]\] .* POST /v1/completions -> 200", line) for line in log), \
            "the other fronts served some"
        async with httpx.AsyncClient(base_url=url) as http:
            served = await metric_value(http, "trillm:request_success_total", finished_reason="length",
                                        model_name=model)
        assert served == 16, "every front's requests, counted by whichever front is asked"

        async def kill_another_front() -> None:
            """SIGKILL a front that does not serve the stream (it named itself in the log)."""
            with trio.fail_after(SETTLE_TIMEOUT):
                while not (lines := [line for line in log if "[the-stream]" in line]):
                    await trio.sleep(0.01)
            serving = int(m[1]) if (m := re.search(r"\[front (\d)\]", lines[0])) else 0
            os.kill(fronts[2 if serving == 1 else 1], signal.SIGKILL)

        # the server stops, as on SIGTERM: every front left drains, so the stream ends whole
        finish, _ = await finish_of_stream(client, model, 200, kill_another_front,
                                           extra_headers={"X-Request-Id": "the-stream"})
        assert finish == "length", "\n".join(log)
        await client.close()
        with trio.fail_after(SETTLE_TIMEOUT):
            assert await process.wait() == 1, "\n".join(log)
        assert any("exited (code -9): stopping the server" in line for line in log), "\n".join(log)
        assert sum("draining" in line for line in log) == 2, "the first front and the one left"
        with trio.fail_after(SETTLE_TIMEOUT):
            while any(live(pid) for pid in processes):
                await trio.sleep(0.05)
