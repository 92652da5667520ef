"""Data-parallel replicas on hosts of their own (network namespaces joined by veth pairs,
tests/netns_support.py), as a user runs them across machines, with the real `openai` client from
outside them: `trillm serve` on two hosts, and on a third `trillm serve --data-parallel-size 0
--data-parallel-address ...`, the router alone in front of them. One replica's host is cut off
(its link taken down: packets lost, nothing refused) while streams run, and the router stops
sending it requests while the other host serves. (test_multi_host_tp.py: tensor parallelism.)"""
import os
import signal
import subprocess
import sys

import openai
import pytest
import trio
from http_support import requests_served
from netns_support import PORT, hosts, until_healthy

pytest.importorskip("vllm_router")
pytestmark = pytest.mark.slow

async def test_replicas_on_two_hosts_behind_a_router_on_a_third_outlive_a_host_cut_off(tiny_text_model_dir):
    model = os.path.basename(tiny_text_model_dir)
    serve = [sys.executable, "-m", "trillm", "serve", "--model", tiny_text_model_dir, "--port", str(PORT),
             "--log-level", "warning"]
    with hosts(3) as (front, first, second):
        replica_urls = [f"http://{host.address}:{PORT}" for host in (first, second)]
        async with trio.open_nursery() as nursery:
            processes = []

            async def start(host, *flags):
                process = await nursery.start(lambda task_status: trio.run_process(
                    host.command([*serve, "--host", host.address, *flags]), stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, check=False, task_status=task_status))
                processes.append(process)
                return process

            try:
                # All three start at once: the front waits for the replicas before its router serves.
                replicas = [await start(host, "--num-kv-blocks", "64") for host in (first, second)]
                router = f"http://{front.address}:{PORT}"
                front_process = await start(front, "--data-parallel-size", "0", "--data-parallel-address",
                                            ",".join(replica_urls), "--router-policy", "round_robin")
                for url, process in [*zip(replica_urls, replicas), (router, front_process)]:
                    await until_healthy(url, process)
                client = openai.AsyncOpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=10)
                for i in range(4):
                    await client.completions.create(model=model, prompt=f"Question {i}:", max_tokens=2)
                assert all([await requests_served(url) > 0 for url in replica_urls]), "round-robin reaches both hosts"

                async def stream(i):  # one stream after another until cancelled, or one hangs on the cut host
                    async with openai.AsyncOpenAI(base_url=router + "/v1", api_key="none", max_retries=0) as c:
                        while True:
                            chunks = await c.completions.create(model=model, prompt=f"Story {i}:", max_tokens=200,
                                                                stream=True, extra_body={"ignore_eos": True})
                            async for _ in chunks:
                                pass

                async with trio.open_nursery() as streams:
                    for i in range(2):  # round-robin: one on each host (more only burn the suite's cores)
                        streams.start_soon(stream, i)
                    await trio.sleep(1)
                    first.cut()
                    before = await requests_served(replica_urls[1])
                    # Requests sent to the cut host before the router's health checks notice wait out
                    # the client's timeout (short: the tiny model answers in milliseconds); from then
                    # on every request is the other host's.
                    in_a_row = 0
                    with trio.fail_after(120):
                        while in_a_row < 6:
                            try:
                                await client.completions.create(model=model, prompt="After the cut:", max_tokens=2,
                                                                timeout=3)
                                in_a_row += 1
                            except (openai.APITimeoutError, openai.APIConnectionError, openai.APIStatusError):
                                in_a_row = 0
                    assert await requests_served(replica_urls[1]) - before >= 6
                    streams.cancel_scope.cancel()
                await client.close()
            finally:
                for process in processes:
                    if process.returncode is None:
                        process.send_signal(signal.SIGKILL if process is processes[0] else signal.SIGTERM)
                with trio.fail_after(60):
                    for process in processes:
                        await process.wait()
