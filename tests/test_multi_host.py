"""trillm across hosts of their own (network namespaces joined by veth pairs,
tests/netns_support.py), as a user runs it across machines, with the real `openai` client from
outside them. Data parallelism: `trillm serve` on two hosts, and on a third `trillm serve
--data-parallel-size 0 --data-parallel-address ...`, the router alone in front of them; one
replica's host is cut off (its link taken down: packets lost, nothing refused) while streams run,
and the router stops sending it requests while the other host serves. Tensor parallelism: two
ranks on two hosts started by torchrun, greedy tokens equal to one rank's, and the second rank's
host cut off mid-stream fails the engine cleanly within --tp-timeout."""
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
import trio
from http_support import EXACT
from netns_support import hosts

from trillm.engine.llm import LLM
from trillm.sampling_params import SamplingParams

pytest.importorskip("sglang_router")
pytestmark = pytest.mark.slow

PORT = 8000


async def served(url: str) -> float:
    """Requests a replica finished, from its own /metrics."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        text = (await http.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("trillm:request_success_total{"))


async def until_healthy(url: str, process: trio.Process) -> None:
    async with httpx.AsyncClient(timeout=2) as http:
        with trio.fail_after(300):
            while True:
                assert process.returncode is None, f"the server for {url} exited with {process.returncode}"
                try:
                    if (await http.get(url + "/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.2)


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
                for host, url in zip((first, second), replica_urls):
                    await until_healthy(url, await start(host, "--num-kv-blocks", "64"))
                router = f"http://{front.address}:{PORT}"
                await until_healthy(router, await start(
                    front, "--data-parallel-size", "0", "--data-parallel-address", ",".join(replica_urls),
                    "--router-policy", "round_robin"))
                client = openai.AsyncOpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=10)
                for i in range(4):
                    await client.completions.create(model=model, prompt=f"Question {i}:", max_tokens=2)
                assert all([await served(url) > 0 for url in replica_urls]), "round-robin reaches both hosts"

                async def stream(i):  # one stream after another until cancelled, or one hangs on the cut host
                    async with openai.AsyncOpenAI(base_url=router + "/v1", api_key="none", max_retries=0) as c:
                        while True:
                            chunks = await c.completions.create(model=model, prompt=f"Story {i}:", max_tokens=200,
                                                                stream=True, extra_body={"ignore_eos": True})
                            async for _ in chunks:
                                pass

                async with trio.open_nursery() as streams:
                    for i in range(4):
                        streams.start_soon(stream, i)
                    await trio.sleep(1)
                    first.cut()
                    before = await served(replica_urls[1])
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
                    assert await served(replica_urls[1]) - before >= 6
                    streams.cancel_scope.cancel()
                await client.close()
            finally:
                for process in processes:
                    if process.returncode is None:
                        process.send_signal(signal.SIGKILL if process is processes[0] else signal.SIGTERM)
                with trio.fail_after(60):
                    for process in processes:
                        await process.wait()


async def test_tensor_parallel_ranks_on_two_hosts_answer_as_one_and_fail_cleanly_when_cut_off(tiny_text_model_dir):
    """torchrun on each host (static rendezvous at the first), rank 0 serving HTTP: greedy
    tokens over the wire equal one unsharded engine's; then the second host's link goes down
    mid-stream, the stream ends in an engine error within --tp-timeout and /health says 503."""
    model = os.path.basename(tiny_text_model_dir)
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3, 4,"]
    with LLM(tiny_text_model_dir, num_kv_blocks=32, **EXACT) as whole:
        want = [o.outputs[0].text for o in whole.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                                                  ignore_eos=True))]
    with hosts(2) as (head, other):
        torchrun = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nnodes", "2", "--nproc-per-node",
                    "1", "--master-addr", head.address, "--master-port", "29511"]
        serve = ["-m", "trillm", "serve", "--model", tiny_text_model_dir, "--tensor-parallel-size", "2",
                 "--tp-timeout", "5", "--num-kv-blocks", "32", "--no-quantized-activations", "--kv-cache-dtype",
                 "float32", "--host", head.address, "--port", str(PORT), "--log-level", "warning"]
        url = f"http://{head.address}:{PORT}"
        async with trio.open_nursery() as nursery:
            processes = []
            for rank, host in enumerate((head, other)):
                # gloo finds its own address by the host name, which no namespace here resolves to
                env = {**os.environ, "GLOO_SOCKET_IFNAME": host.inner_link}
                processes.append(await nursery.start(lambda task_status, rank=rank, host=host, env=env: trio.run_process(
                    host.command([*torchrun, "--node-rank", str(rank), *serve]), env=env, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, check=False, task_status=task_status)))
            try:
                await until_healthy(url, processes[0])
                client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
                got = [(await client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0,
                                                        extra_body={"ignore_eos": True})).choices[0].text
                       for p in prompts]
                assert got == want
                stream = await client.completions.create(model=model, prompt="Once upon a time", max_tokens=240,
                                                         stream=True, extra_body={"ignore_eos": True})
                with trio.fail_after(60), pytest.raises(Exception) as failed:  # --tp-timeout is 5 s
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].text and not other.is_cut:
                            other.cut()
                assert "engine" in str(failed.value).lower()
                async with httpx.AsyncClient(timeout=10) as http:
                    assert (await http.get(url + "/health")).status_code == 503
                await client.close()
            finally:
                for process in processes:
                    if process.returncode is None:
                        process.send_signal(signal.SIGKILL)
                with trio.fail_after(60):
                    for process in processes:
                        await process.wait()
