"""vLLM's `priority` under `--scheduling-policy priority`: who runs first, through a live server."""
import openai
import pytest
import trio

from http_support import TINY_KV_BLOCKS, frozen_engine, live_server, settled_stats
from trillm.config import EngineArgs
from trillm.engine.core import EngineCore

ENDLESS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def one_seat_core(tiny_text_model_dir):
    """One request runs at a time, so the order of finishing is the order of running."""
    return EngineCore(EngineArgs(model=tiny_text_model_dir, num_kv_blocks=TINY_KV_BLOCKS, max_num_seqs=1,
                                 scheduling_policy="priority"))


async def test_a_better_priority_runs_first_and_preempts_a_worse_one(one_seat_core):
    async with live_server(one_seat_core) as server:
        client = server.openai()
        finished = []

        async def complete(name: str, priority: int, max_tokens: int) -> None:
            out = await client.completions.create(model=server.model, prompt=[5, 6, 7], max_tokens=max_tokens,
                                                  extra_body={**ENDLESS, "priority": priority})
            assert out.usage.completion_tokens == max_tokens
            finished.append(name)

        async with trio.open_nursery() as nursery:
            with frozen_engine(one_seat_core):  # everything below is queued before the engine moves
                nursery.start_soon(complete, "first-come", 0, 30)
                await trio.sleep(0.3)
                nursery.start_soon(complete, "low", 5, 10)
                nursery.start_soon(complete, "high", -5, 10)
                await trio.sleep(0.3)
        # high outranks what runs (first-come) and preempts it; low waits for both.
        assert finished == ["high", "first-come", "low"]
        stats = await settled_stats(server.http())
        assert stats["num_preemptions"] >= 1 and stats["num_used_blocks"] == 0


async def test_priority_needs_the_priority_policy(server):
    with pytest.raises(openai.BadRequestError) as refused:
        await server.openai().completions.create(model=server.model, prompt="Hi", max_tokens=1,
                                                 extra_body={"priority": 1})
    assert refused.value.body["param"] == "priority"
    ok = await server.openai().completions.create(model=server.model, prompt="Hi", max_tokens=1,
                                                  extra_body={"priority": 0})
    assert ok.usage.completion_tokens == 1
