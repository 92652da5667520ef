"""Tensor-parallel ranks on hosts of their own (network namespaces joined by veth pairs,
tests/netns_support.py), started by torchrun as across machines, with the real `openai` client
from outside them: greedy tokens equal one unsharded engine's, and the second rank's host cut off
mid-stream (its link taken down: packets lost, nothing refused) fails the engine cleanly within
--tp-timeout. (test_multi_host.py: data parallelism.)"""
import contextlib
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
import trio
from http_support import EXACT
from netns_support import PORT, hosts, until_healthy
from process_support import descendants, live

from trillm.engine.llm import LLM
from trillm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


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
                 "--tp-timeout", "4", "--num-kv-blocks", "32", "--no-quantized-activations", "--kv-cache-dtype",
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
                with trio.fail_after(60), pytest.raises(Exception) as failed:  # --tp-timeout is 4 s
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].text and not other.is_cut:
                            other.cut()
                assert "engine" in str(failed.value).lower()
                async with httpx.AsyncClient(timeout=10) as http:
                    assert (await http.get(url + "/health")).status_code == 503
                await client.close()
            finally:
                # torchrun killed leaves its rank behind (it forwards SIGTERM, not SIGKILL): the
                # ranks go first, then the launchers, and none may be left
                ranks = set().union(*(descendants(p.pid) for p in processes if p.returncode is None))
                for pid in ranks:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                for process in processes:
                    if process.returncode is None:
                        process.send_signal(signal.SIGKILL)
                with trio.fail_after(60):
                    for process in processes:
                        await process.wait()
                    while any(map(live, ranks)):
                        await trio.sleep(0.05)
