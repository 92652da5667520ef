"""The server on a CUDA device, end to end (marker `cuda`: skipped without one).

- The default model, in bf16 on the Triton kernels with CUDA graphs, streams a chat reply through
  the `openai` client; a stream cut off mid-reply and a request aborted through `/abort_request`
  both give every KV block back.
- The engine in its own process (`trillm serve`'s CUDA default) serves as the core in this one.
- Sleep levels 1 and 2 give device memory back (the KV cache and the weights: level 1 moves
  them to host memory, level 2 drops them) and wake to the same greedy tokens.
"""
from __future__ import annotations

import pytest
import torch
import trio

from http_support import greedy_ids, live_server, settled_stats
from trillm.config import EngineArgs
from trillm.engine.api import EngineCore, EngineProcess

pytestmark = pytest.mark.cuda


def cuda_core(**args) -> EngineCore:
    return EngineCore(EngineArgs(device="cuda", num_kv_blocks=256, **args))


def assert_every_block_back(stats: dict) -> None:
    """No request holds a block; the prompts' full blocks may stay in the prefix cache (free to evict)."""
    assert stats["num_used_blocks"] == 0 and stats["num_running"] == 0
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == stats["num_kv_blocks"]
    assert stats["num_cached_blocks"] > 0, "the chat prompt's full blocks were cached"


def device_bytes_of_weights_and_cache(runner) -> int:
    """Device bytes the KV cache and the weights hold, each storage once (tied embeddings, K and V
    carved from one allocation). A function of its own so that no tensor it looks at outlives
    it: a test that kept them in a local kept them all on the device through the sleep."""
    tensors = [t for kv in runner.kv_caches for t in kv] + list(runner.model.state_dict().values())
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cuda}.values())


async def test_the_default_model_streams_on_cuda_and_aborts_free_their_blocks():
    with cuda_core() as core:
        assert core.config.device.type == "cuda" and core.runner.model.kernels.name == "triton"
        assert core.runner.decode_graphs is not None  # CUDA graphs are on by default
        async with live_server(core) as server:
            client, http = server.openai(), server.http()
            messages = [{"role": "user", "content": "Name three colours."}]
            reply = await client.chat.completions.create(model=server.model, messages=messages, max_tokens=24,
                                                         temperature=0)
            assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
            stream = await client.chat.completions.create(model=server.model, messages=messages, max_tokens=24,
                                                          temperature=0, stream=True)
            streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
            assert streamed == reply.choices[0].message.content  # greedy, batched or not

            # A stream cut off after its first tokens
            stream = await client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=500,
                                                     stream=True, extra_body={"ignore_eos": True})
            async for _ in stream:
                break
            await stream.close()
            assert_every_block_back(await settled_stats(http))

            # An abort by request id, while the request decodes
            async with trio.open_nursery() as nursery:
                async def long_request():
                    await http.post("/v1/completions", headers={"X-Request-Id": "long-one"},
                                    json={"model": server.model, "prompt": "Once", "max_tokens": 2000,
                                          "ignore_eos": True}, timeout=120)

                nursery.start_soon(long_request)
                with trio.fail_after(60):
                    while (await http.get("/server_info")).json()["stats"]["num_live_requests"] == 0:
                        await trio.sleep(0.01)
                assert (await http.post("/abort_request", json={"rid": "long-one"})).status_code == 200
            assert_every_block_back(await settled_stats(http))


async def test_the_engine_in_its_own_process_serves_on_cuda_as_in_this_one():
    """`trillm serve`'s CUDA default, the engine in a process of its own: the same greedy tokens
    and embeddings (which cross on the host) as the core in the server's process."""
    async def ask(engine):
        async with live_server(engine) as server:
            client = server.openai()
            ids = await greedy_ids(client, server.model, max_tokens=16)
            vector = await client.embeddings.create(model=server.model, input="a b", encoding_format="float")
            return ids, vector.data[0].embedding

    with EngineProcess(EngineArgs(device="cuda", num_kv_blocks=256)) as apart:
        remote = await ask(apart)
    with cuda_core() as core:
        local = await ask(core)
    assert remote[0] == local[0]
    torch.testing.assert_close(torch.tensor(remote[1]), torch.tensor(local[1]))


@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_gives_device_memory_back_and_wakes_to_the_same_tokens(level):
    with cuda_core(enable_sleep_mode=True) as core:
        async with live_server(core) as server:
            client, http = server.openai(), server.http()

            async def greedy() -> list[int]:
                out = await client.completions.create(model=server.model, prompt="The capital of France is",
                                                      max_tokens=8, temperature=0,
                                                      extra_body={"return_token_ids": True, "ignore_eos": True})
                return out.choices[0].model_extra["token_ids"]

            before = await greedy()
            on_device = device_bytes_of_weights_and_cache(core.runner)
            torch.cuda.synchronize()
            awake = torch.cuda.memory_allocated()
            response = await http.post(f"/sleep?level={level}")
            assert response.status_code == 200, response.text
            # On CUDA both levels take the weights off the device (level 1 to host memory) and free the cache.
            assert awake - torch.cuda.memory_allocated() > 0.9 * on_device
            assert (await http.post("/wake_up")).json() == {"is_sleeping": False}
            assert torch.cuda.memory_allocated() >= awake * 0.9
            assert await greedy() == before
