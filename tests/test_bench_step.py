"""benchmarks/bench_step.py, the engine-alone comparison most kernel changes are judged by: its
prefill figures must be of whole prompts, every token computed in the time they report."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

import bench_step  # noqa: E402

from trillm.config import EngineArgs  # noqa: E402
from trillm.engine.core import EngineCore  # noqa: E402


def test_a_timed_prefill_finds_nothing_cached(tiny_text_model_dir):
    """After a decode batch of the same text, each length's rounds and a longer prompt after a
    shorter one compute every token: the prefix cache answers none of them."""
    core = EngineCore(EngineArgs(model=tiny_text_model_dir, num_kv_blocks=64))
    bench_step.decode_step_ms(core, batch=2, rounds=1, prompt_len=48, output_len=6, distinct=True)
    bench_step.decode_step_ms(core, batch=2, rounds=1, prompt_len=48, output_len=6)
    before = core.stats()
    for length in (16, 40, 48):
        bench_step.prefill_ms(core, length, rounds=2)
    after = core.stats()
    assert after.prefix_cache_queries > before.prefix_cache_queries  # the prompts were looked up
    assert after.prefix_cache_hits == before.prefix_cache_hits


def test_a_prompt_longer_than_a_step_is_timed_over_all_its_steps(tiny_text_model_dir):
    """A prompt the step budget cuts in chunks is timed to its first token, every chunk's step
    included (the first step alone was once reported as the whole prompt's)."""
    core = EngineCore(EngineArgs(model=tiny_text_model_dir, num_kv_blocks=64, max_num_batched_tokens=16))
    ms, steps = bench_step.prefill_ms(core, 40, rounds=1)
    assert steps == 3 and ms > 0 and not core.has_unfinished()
