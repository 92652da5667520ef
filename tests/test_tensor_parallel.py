"""Tensor parallelism over gloo on loopback: the ranks are real processes the engine starts.
Greedy tokens and logprobs at TP > 1 equal TP = 1 (fp32, the exact path), with KV heads split
and replicated, on tiny random models and on the default model through a live server; a worker
killed mid-stream fails the engine like any failed step, and no rank outlives its engine."""
import contextlib
import json
import os
import signal
import subprocess
import sys

import process_support
import pytest
import torch
import trio
from http_support import EXACT, exact_core, live_server

from trillm.config import EngineArgs
from trillm.engine.core import EngineCore
from trillm.engine.llm import LLM
from trillm.model.loader import default_model_path
from trillm.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], list(range(50, 90))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)


def children() -> set[int]:
    """What this process started and is alive (the fork server ranks come from aside)."""
    return process_support.started_by(os.getpid())


@contextlib.contextmanager
def opened(model: str, tp: int, **engine_args):
    """An LLM at `tp` ranks on the exact path, closed (twice: idempotent) on leaving; checks that
    it started one process per other rank and that none outlives it."""
    before = children()
    llm = LLM(model, tensor_parallel_size=tp, num_kv_blocks=32, **EXACT, **engine_args)
    try:
        assert len(children() - before) == tp - 1, "the engine starts one process per other rank"
        yield llm
    finally:
        llm.engine.close()
        llm.engine.close()
    assert children() == before, "no rank outlives its engine"


def tokens_and_logprobs(outputs) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outputs]


def greedy(model: str, tp: int, **engine_args) -> list[tuple[list[int], list[float]]]:
    with opened(model, tp, **engine_args) as llm:
        return tokens_and_logprobs(llm.generate(PROMPTS, GREEDY))


def assert_same(sharded, whole):
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(sharded, whole):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind, overrides, tp", [
    # KV heads split (4 heads, 2 KV heads, TP = 2): the shared engine below, with drafts
    ("llama", dict(num_attention_heads=4, num_key_value_heads=1), 2),  # KV heads replicated (GQA)
    ("qwen2", dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=96, vocab_size=250), 2),  # biases, uneven vocab
    ("llama", dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=96), 3),
])
def test_sharded_greedy_equals_whole(tiny_model_dir, kind, overrides, tp):
    model = tiny_model_dir(kind, **overrides)
    assert_same(greedy(model, tp), greedy(model, 1))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_kernel_family_runs_sharded(tiny_model_dir, backend):
    """The torch twins and the Triton kernels (in the interpreter here) on their shards."""
    if backend == "triton":
        pytest.importorskip("triton")
    model = tiny_model_dir("llama", num_attention_heads=4, num_key_value_heads=2)
    assert_same(greedy(model, 2, attention_backend=backend), greedy(model, 1, attention_backend=backend))


@pytest.mark.parametrize("form", ["hf-dir", "gguf"])
async def test_default_model_at_tp3_through_a_live_server(default_model_dir, form):
    """SmolLM2's 9 heads and 3 KV heads over 3 ranks: its converted directory's tensors, and its
    file's blocks in place, cut on block boundaries (the vocabulary's as they come, by slices)."""
    model = default_model_dir if form == "hf-dir" else default_model_path()
    args = dict(model=model, max_tokens=6, temperature=0, logprobs=2)
    whole = exact_core(model)
    sharded = await trio.to_thread.run_sync(
        lambda: EngineCore(EngineArgs(model=model, tensor_parallel_size=3, num_kv_blocks=64, **EXACT)))
    try:
        # every projection on the blocks, as the whole engine runs them: the vocabulary's too
        assert (sharded.runner.model.lm_head.quantized is None) == (whole.runner.model.lm_head.quantized is None)
        answers = []
        for core in (whole, sharded):
            async with live_server(core) as server:
                out = await server.openai().completions.create(prompt=["The capital of France is", "1, 2, 3,"],
                                                               **{**args, "model": server.model})
                answers.append([(c.logprobs.tokens, c.logprobs.token_logprobs) for c in out.choices])
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(answers[1], answers[0]):
            assert tokens == want_tokens
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)
    finally:
        await trio.to_thread.run_sync(sharded.close)


def test_a_rank_gone_before_the_ranks_meet_fails_rank_0_at_once():
    """Rank 0 waits for the others at the meeting point while watching that they still run (the
    engine gives it its workers' liveness): one that has exited (here: never came) ends the
    wait with an error, where the meeting itself would wait for it for half an hour."""
    import threading

    import torch.distributed as dist

    from trillm.model import parallel
    from trillm.subprocesses import free_port

    outcome = []

    def rank_0():
        try:
            parallel.join(0, 2, f"tcp://127.0.0.1:{free_port()}", torch.device("cpu"), 30, others_alive=lambda: False)
        except RuntimeError as exc:
            outcome.append(exc)

    waiting = threading.Thread(target=rank_0, daemon=True)  # without the check it would wait 30 minutes
    waiting.start()
    waiting.join(30)
    assert not waiting.is_alive(), "rank 0 waited for a rank that is gone"
    assert "exited before the ranks met" in str(outcome[0])
    assert not dist.is_initialized()


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
async def test_a_dead_or_hung_worker_fails_the_engine_and_leaves_no_process(tiny_text_model_dir, fault):
    """A killed worker's closed connections fail the next step at once; a stopped one (hung)
    fails it after --tp-timeout."""
    before = children()
    core = await trio.to_thread.run_sync(
        lambda: EngineCore(EngineArgs(model=tiny_text_model_dir, tensor_parallel_size=2, num_kv_blocks=64,
                                      tp_timeout=3, **EXACT)))
    try:
        async with live_server(core) as server:
            client = server.openai()
            stream = await client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=240,
                                                     stream=True, extra_body={"ignore_eos": True})
            faulted = []
            with pytest.raises(Exception) as failed:
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text and not faulted:
                        os.kill(core.workers.processes[0].pid, fault)
                        faulted.append(fault)
            assert "engine" in str(failed.value).lower()
            health = await server.http().get("/health")
            assert health.status_code == 503
    finally:
        await trio.to_thread.run_sync(core.close)
    assert children() == before


def test_closing_an_engine_again_leaves_a_later_engines_group_be(tiny_model_dir):
    """The process has one group: an engine closed a second time, after another has joined it
    since, must not take it from that one."""
    model = tiny_model_dir("llama", num_attention_heads=4, num_key_value_heads=2)
    with opened(model, 2) as first:
        pass
    with opened(model, 2) as second:
        first.engine.close()
        (out,) = second.generate(PROMPTS[:1], GREEDY)
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_an_engine_that_fails_to_load_leaves_no_rank_and_no_group():
    """A model that is not there fails rank 0's load after the ranks joined: the engine stops them
    and leaves the group, so the process can build the next one."""
    before = children()
    with pytest.raises(FileNotFoundError):
        LLM("/nonexistent-model", tensor_parallel_size=2)
    assert children() == before and not torch.distributed.is_initialized()


def test_a_rank_whose_start_was_given_up_exits_quietly(tiny_model_dir):
    """Rank 0 stops waiting when one rank fails to start, and closes every rank's pipe; a rank
    that gets that far only then finds nobody to report to, and exits without a traceback and
    without trying to meet."""
    import multiprocessing

    from trillm.model.tp_worker import _rank_main

    reader, writer = multiprocessing.Pipe(duplex=False)
    reader.close()
    args = EngineArgs(model=tiny_model_dir("llama"), tensor_parallel_size=2, tp_init_method="tcp://127.0.0.1:1")
    assert _rank_main(args, 1, writer) is None
    assert writer.closed


def test_a_script_without_a_main_guard_fails_at_once_and_says_why(tiny_model_dir, tmp_path):
    """The ranks fork from multiprocessing's fork server, which imports a script's main module
    again: a script that builds the engine at its top level gets a clear error, not a rank 0
    that waits for ranks which never start."""
    model = tiny_model_dir("llama", num_attention_heads=4, num_key_value_heads=2)
    script = tmp_path / "unguarded.py"
    script.write_text(f"from trillm import LLM\nLLM({model!r}, tensor_parallel_size=2)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "rank 1 exited before it started" in done.stderr, done.stderr[-2000:]
    assert 'if __name__ == "__main__":' in done.stderr


@pytest.fixture(scope="module")
def split_heads_tp2(tiny_model_dir):
    """(model, an LLM at TP = 2 on it, KV heads split over the ranks, drafting from every n-gram),
    shared by the tests that need nothing else of it (starting ranks is most of their cost). Its
    users come last in the module: the engine holds the process's group until the module ends."""
    model = tiny_model_dir("llama", num_attention_heads=4, num_key_value_heads=2)
    drafts = json.dumps({"method": "ngram", "prompt_lookup_min": 1, "disable_by_batch_size": 0})
    with opened(model, 2, speculative_config=drafts, tp_timeout=10) as llm:
        yield model, llm


def test_drafts_are_verified_on_every_rank(split_heads_tp2):
    """Speculative decoding under TP: a verification's rows get logits on every rank (the
    vocabulary's shards are gathered for each), and greedy output is TP = 1's without drafts."""
    model, llm = split_heads_tp2
    drafted = llm.engine.stats().spec_decode_num_draft_tokens
    sharded = tokens_and_logprobs(llm.generate(PROMPTS, GREEDY))
    assert llm.engine.stats().spec_decode_num_draft_tokens > drafted
    assert_same(sharded, greedy(model, 1, speculative_config=""))


def test_prompt_logprobs_and_teacher_forcing_are_sharded_too(split_heads_tp2):
    """Logits beyond the sampled rows (prompt logprobs, teacher forcing) are projected on every
    rank too, as the vocabulary's shards must be: equal to TP = 1's."""
    model, sharded = split_heads_tp2
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    results = []
    with opened(model, 1) as whole:
        for llm in (whole, sharded):
            (out,) = llm.generate([PROMPTS[2]], params)
            entries = out.outputs[0].prompt_logprobs
            forced = llm.engine.runner.teacher_forced_logits(PROMPTS[2], chunk=16)
            results.append(([e.logprob for e in entries[1:]], [e.top for e in entries[1:]], forced))
    (logprobs, tops, forced), (want_logprobs, want_tops, want_forced) = results[1], results[0]
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)
    assert [[t for t, _ in top] for top in tops] == [[t for t, _ in top] for top in want_tops]
    torch.testing.assert_close(forced, want_forced, atol=1e-4, rtol=0)
