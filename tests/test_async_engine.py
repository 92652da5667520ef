"""AsyncEngine on the real default model: admission, the group channel, and every way a request
ends early (abort, a closed stream, a stop, a drain, shutdown, the engine dying), each one
freeing the request's KV blocks before the engine's next step."""
import threading

import pytest
import trio
import trio.testing

from trillm import SamplingParams
from trillm.engine.api import AsyncEngine, EngineUnavailableError, QueueFullError, RequestGroup
from trillm.sampling_params import SamplingParamError, StructuredOutput

LONG_RUN = SamplingParams(max_tokens=1000, ignore_eos=True)  # ends only when stopped


@pytest.fixture
def prompt(core):
    return core.tokenizer.encode("Once upon a time, in a small village nestled between two mountains,")


@pytest.fixture
async def engine(core):
    engine = AsyncEngine(core, max_waiting=64)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        yield engine
        await engine.aclose()
    assert core.stats().num_used_blocks == 0 and not core.has_unfinished()


async def until_idle(engine: AsyncEngine) -> dict:
    with trio.fail_after(60):
        while engine.stats().num_live_requests:
            await trio.sleep(0.01)
    return engine.stats()


async def test_abort_frees_the_blocks_before_the_next_step(engine, prompt):
    stream = await engine.add(RequestGroup("a", [(prompt, LONG_RUN)]))
    outputs = []
    async for index, out in stream:
        assert index == 0
        outputs.append(out)
        if len(outputs) == 3:
            assert engine.stats().num_used_blocks > 0
            steps_at_abort = engine.num_steps
            assert engine.abort("a")
    final = outputs[-1]
    assert (final.finished, final.finish_reason, final.new_token_ids) == (True, "abort", [])
    # The step in flight when abort() was called may still finish; no step after it runs the request.
    assert engine.num_steps - steps_at_abort <= 1
    assert engine.stats().num_used_blocks == 0 and not engine.abort("a")


async def test_closing_a_stream_aborts_its_request(engine, prompt):
    stream = await engine.add(RequestGroup("a", [(prompt, LONG_RUN)]))
    await anext(stream)
    stream.close()  # what a handler does when its client goes away
    stats = await until_idle(engine)
    assert stats.num_used_blocks == 0 and stats.num_running == 0


async def test_a_reader_that_fell_behind_takes_what_it_missed_at_once(engine, prompt):
    """Outputs that wait in the channel come as one: the same tokens and logprobs, one write."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    prompt_reader = [out async for _, out in await engine.add(RequestGroup("prompt", [(prompt, params)]))]
    behind = await engine.add(RequestGroup("behind", [(prompt, params)]))
    with trio.fail_after(60):
        await engine.live.idle.wait()  # every output is in the channel, unread
    caught_up = [out async for _, out in behind]
    assert len(prompt_reader) > 1 and len(caught_up) == 1
    (last,) = caught_up
    assert last.finished and last.finish_reason == "length"
    assert last.new_token_ids == [t for out in prompt_reader for t in out.new_token_ids]
    assert [lp.logprob for lp in last.new_logprobs] == pytest.approx(
        [lp.logprob for out in prompt_reader for lp in out.new_logprobs], abs=1e-4)


async def test_samples_of_one_prompt_share_its_cached_blocks(engine, core, prompt):
    assert await engine.reset_prefix_cache()
    long_prompt = prompt * 3
    group = RequestGroup("n", [(long_prompt, SamplingParams(max_tokens=2, seed=i)) for i in range(3)])
    stream = await engine.add(group)
    cached = {}
    async for index, out in stream:
        cached[index] = out.num_cached_tokens
    full_blocks = core.args.block_size * ((len(long_prompt) - 1) // core.args.block_size)
    assert full_blocks > 0
    assert cached == {0: 0, 1: full_blocks, 2: full_blocks}, "later samples start after the first one's prefill"


async def test_stopping_one_member_leaves_the_others_running(engine, prompt):
    group = RequestGroup("g", [(prompt, LONG_RUN), (prompt[:-1], SamplingParams(max_tokens=4, ignore_eos=True))])
    stream = await engine.add(group)
    finals = {}
    async for index, out in stream:
        if index == 0 and 0 not in finals and not out.finished:
            stream.stop(0)  # as if a stop string matched in member 0's text
        if out.finished:
            finals[index] = (out.finish_reason, out)
    assert finals[0][0] == "stop" and finals[1][0] == "length"
    assert engine.stats().num_used_blocks == 0


async def test_refused_admissions(engine, core, prompt):
    with pytest.raises(SamplingParamError) as too_long:
        await engine.add(RequestGroup("long", [([1] * (core.config.max_model_len + 1), SamplingParams())]))
    assert too_long.value.param == "prompt"
    assert (await until_idle(engine)).num_used_blocks == 0


def calls_on_the_loop(monkeypatch, core, *names: str) -> list[tuple[str, bool]]:
    """A list that records each call of the core's methods `names` from then on: its name, and
    whether it ran on the event loop's thread."""
    calls = []

    def recorded(name, method):
        def call(*args, **kwargs):
            calls.append((name, threading.current_thread() is threading.main_thread()))
            return method(*args, **kwargs)
        return call

    for name in names:
        monkeypatch.setattr(core, name, recorded(name, getattr(core, name)))
    return calls


async def test_each_member_is_checked_once_and_off_the_event_loop(engine, core, prompt, monkeypatch):
    """check_request scans the prompt (token ids against the vocabulary): the front runs it in a
    worker thread, and the engine task, on the event loop, does not run it again."""
    checks = calls_on_the_loop(monkeypatch, core, "check_request")
    group = RequestGroup("twice", [(prompt, SamplingParams(max_tokens=2)), (prompt[:-1], SamplingParams(max_tokens=2))])
    stream = await engine.add(group)
    assert [out.finish_reason for _, out in [x async for x in stream] if out.finished] == ["length", "length"]
    assert checks == [("check_request", False)] * 2


async def test_admissions_run_off_the_event_loop(engine, core, prompt, monkeypatch):
    """Admitting copies a prompt and hashes its blocks, work that grows with it: the engine task
    does it in the step's worker thread, a repeated prompt's deferred sample too (admitted after
    its twin's first token), and an abort's as well; the event loop only settles the outcome."""
    on_loop = calls_on_the_loop(monkeypatch, core, "add_request", "abort_request")
    twins = await engine.add(RequestGroup("twins", [(prompt, SamplingParams(max_tokens=2))] * 2))
    assert [out.finish_reason for _, out in [x async for x in twins] if out.finished] == ["length", "length"]
    stream = await engine.add(RequestGroup("aborted", [(prompt, LONG_RUN)]))
    await anext(stream)
    assert engine.abort("aborted")
    assert [out.finish_reason async for _, out in stream if out.finished] == ["abort"]
    assert on_loop == [("add_request", False)] * 3 + [("abort_request", False)]


async def test_waiting_queue_limit(core, prompt):
    engine = AsyncEngine(core, max_waiting=1)

    async def first_request():
        stream = await engine.add(RequestGroup("first", [(prompt, SamplingParams(max_tokens=2))]))
        assert [out async for _, out in stream][-1].finish_reason == "length"
        await engine.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first_request)
        # "first" is registered once its checks' worker thread has returned; the engine task is
        # not running yet, so it stays waiting.
        with trio.fail_after(30):
            while engine.live.unfinished_members == 0:
                await trio.sleep(0.001)
        with pytest.raises(QueueFullError):
            await engine.add(RequestGroup("second", [(prompt, SamplingParams(max_tokens=2))]))
        await nursery.start(engine.run)


async def test_drain_lets_running_requests_finish_and_refuses_new_ones(engine, prompt):
    short = await engine.add(RequestGroup("short", [(prompt, SamplingParams(max_tokens=3, ignore_eos=True))]))
    await engine.drain(timeout=60)  # returns once "short" has finished
    assert [out.finish_reason for _, out in [x async for x in short]][-1] == "length"
    with pytest.raises(EngineUnavailableError):
        await engine.add(RequestGroup("late", [(prompt, SamplingParams())]))


async def test_drain_timeout_aborts(engine, prompt):
    endless = await engine.add(RequestGroup("endless", [(prompt, LONG_RUN)]))
    await anext(endless)
    await engine.drain(timeout=0)
    assert [out async for _, out in endless][-1].finish_reason == "abort"


async def test_aclose_aborts_live_requests(core, prompt):
    engine = AsyncEngine(core, max_waiting=64)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        stream = await engine.add(RequestGroup("live", [(prompt, LONG_RUN)]))
        await anext(stream)
        await engine.aclose()
        assert [out async for _, out in stream][-1].finish_reason == "abort"
        with trio.fail_after(10), pytest.raises(EngineUnavailableError, match="shutting down"):
            await engine.call_core("reset_prefix_cache")
    assert core.stats().num_used_blocks == 0


async def test_a_dying_engine_fails_streams_and_refuses_requests(core, prompt, monkeypatch):
    """A step that raises (before touching the core) stands for the model crashing."""
    def crash():
        raise RuntimeError("injected fault")

    monkeypatch.setattr(core, "step", crash)
    engine = AsyncEngine(core, max_waiting=64)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            stream = await engine.add(RequestGroup("doomed", [(prompt, LONG_RUN)]))
            with pytest.raises(EngineUnavailableError, match="injected fault"):
                await anext(stream)
            assert isinstance(engine.error, RuntimeError)
            with pytest.raises(EngineUnavailableError):
                await engine.add(RequestGroup("next", [(prompt, SamplingParams())]))
            with trio.fail_after(10), pytest.raises(EngineUnavailableError):  # not left waiting for a reply
                await engine.call_core("reset_prefix_cache")
            await engine.aclose()
    finally:
        core.abort_request("doomed-0")  # the dead engine left it in the core
    assert core.stats().num_used_blocks == 0


async def test_steps_and_compiles_do_not_wait_on_the_default_thread_limiter(engine, prompt):
    """Whatever else in the process holds every token of Trio's default thread limiter (40 slow
    calls in worker threads), the engine still steps and grammars still compile."""
    default = trio.to_thread.current_default_thread_limiter()
    holders = [object() for _ in range(int(default.total_tokens))]
    for holder in holders:
        default.acquire_on_behalf_of_nowait(holder)
    try:
        schema = SamplingParams(max_tokens=4, structured_output=StructuredOutput("json_schema", '{"type": "integer"}'))
        with trio.fail_after(60):
            members = [(prompt, schema), (prompt, SamplingParams(max_tokens=3, ignore_eos=True))]
            stream = await engine.add(RequestGroup("a", members))
            tokens = [0, 0]
            async for index, out in stream:
                tokens[index] += len(out.new_token_ids)
        assert tokens[1] == 3 and tokens[0] >= 1
    finally:
        for holder in holders:
            default.release_on_behalf_of(holder)
