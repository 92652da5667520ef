"""Soak: hundreds of concurrent streams against a live server, a third of the clients going away
at random moments, a third aborted through /abort_request, the rest completing. Afterwards
nothing is leaked (KV blocks, engine tables, Trio tasks, threads) and nothing is lost (every
completed stream has all its tokens and one correct final chunk), and the server still answers.

The model is tiny and random (SmolLM2's tokenizer), so the cost is the serving path, not the
model; the KV pool is smaller than the load wants, so requests also wait and get preempted.
benchmarks/soak.py runs the same soak longer and bigger.
"""
import pytest
from http_support import live_server, tiny_core
from soak_support import check_no_leaks, run_soak

NUM_REQUESTS = 240


@pytest.fixture(scope="session")
def core(tiny_text_model_dir):
    return tiny_core(tiny_text_model_dir)


@pytest.mark.slow
async def test_soak_with_disconnects_and_aborts_leaks_nothing_and_loses_nothing(core):
    async with live_server(core) as server:
        report = await run_soak(server, NUM_REQUESTS, seed=0)
        assert report.num_completed + report.num_disconnected + report.num_aborted == NUM_REQUESTS
        assert report.num_completed and report.num_disconnected and report.num_aborted
        assert report.num_5xx == 0
        await check_no_leaks(server, report)
        print(report.summary())
        assert report.blocks_leaked == 0
        ok = await server.openai().completions.create(
            model=server.model, prompt="Still there?", max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert ok.usage.completion_tokens == 3 and ok.choices[0].finish_reason == "length"
