"""--data-parallel-peers: a replica hands the admin calls it gets on to the other replicas, once,
and says which one refused or could not be reached (two live servers on loopback)."""
import httpx
import openai
import trio
from http_support import live_server

from trillm.config import EngineArgs
from trillm.engine.core import EngineCore
from trillm.http.peer_relay import RELAYED_HEADER


async def test_a_flush_reaches_the_peers_which_can_refuse_and_a_relayed_call_goes_no_further(tiny_text_model_dir):
    cores = await trio.to_thread.run_sync(lambda: [
        EngineCore(EngineArgs(model=tiny_text_model_dir, num_kv_blocks=64)) for _ in range(2)])
    try:
        async with live_server(cores[1]) as peer, live_server(cores[0], data_parallel_peers=peer.url) as first:
            model = first.model
            await peer.openai().completions.create(model=model, prompt=[5] * 40, max_tokens=1)
            assert cores[1].scheduler.allocator.cached_keys, "the peer cached the prompt's blocks"
            async with httpx.AsyncClient(base_url=first.url) as http:
                assert (await http.post("/reset_prefix_cache")).status_code == 200
                assert not cores[1].scheduler.allocator.cached_keys, "the flush reached the peer"

                # The peer is busy: it refuses a flush, and the first replica says so.
                client = openai.AsyncOpenAI(base_url=peer.url + "/v1", api_key="none", max_retries=0)
                stream = await client.completions.create(model=model, prompt=[5, 6], max_tokens=240, n=8, stream=True,
                                                         extra_body={"ignore_eos": True})
                await stream.__anext__()
                refused = await http.post("/flush_cache")
                assert refused.status_code == 400, refused.text
                message = refused.json()["error"]["message"]
                assert f"the replica at {peer.url} answered 400" in message and "while requests are running" in message
                # A call relayed by a peer is this replica's alone: it does not go back to the busy one.
                alone = await http.post("/flush_cache", headers={RELAYED_HEADER: "1"})
                assert alone.status_code == 200, alone.text
                await stream.close()
                await client.close()

        async with live_server(cores[0], data_parallel_peers="http://127.0.0.1:1") as lonely:
            async with httpx.AsyncClient(base_url=lonely.url) as http:
                unreachable = await http.post("/flush_cache")
            assert unreachable.status_code == 503
            assert "the replica at http://127.0.0.1:1 could not be reached" in unreachable.json()["error"]["message"]
    finally:
        for core in cores:
            await trio.to_thread.run_sync(core.close)
