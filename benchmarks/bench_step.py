"""The engine's step on the default model, as requests see it: the median time of one
EngineCore.step() while every request of a batch decodes (scheduler, model, sampler,
bookkeeping), best of three rounds; and the steps that prefill one prompt of each
--prefill-lens to its first token (as many as the step budget cuts it into), best of three.
For comparing two versions of the engine.

    PYTHONPATH=. python benchmarks/bench_step.py --batch-sizes 1 32 --prefill-lens 512 1024

One torch thread (and by default one kernel thread), greedy, ignore_eos, 128-token prompts (each request's differs in its last
token, so none shares its last block; with --distinct-prompts in its first, so none shares any), 40 output tokens. Drafting is off unless --speculative-config
names it: verified drafts make a step emit several tokens, and such steps are not counted.
"""
import argparse
import atexit
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from trillm import SamplingParams  # noqa: E402
from trillm.config import EngineArgs  # noqa: E402
from trillm.engine.core import EngineCore  # noqa: E402
from trillm.kernels.quant_cpu import ISAS, Int8QuantizedLinear, isas  # noqa: E402

PROMPT = "Once upon a time, in a small village nestled between two mountains, " * 12


def decode_step_ms(core: EngineCore, batch: int, rounds: int, prompt_len: int, output_len: int,
                   distinct: bool = False) -> float:
    prompt = core.tokenizer.encode(PROMPT * (1 + prompt_len // 100))[: prompt_len - 1]
    best = float("inf")
    for r in range(rounds):
        for i in range(batch):
            params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
            token = 100 + i + 37 * r
            core.add_request(f"b{batch}-{r}-{i}", [token] + prompt if distinct else prompt + [token], params)
        times = []
        while core.has_unfinished():
            start = time.perf_counter()
            outputs = core.step()
            elapsed = time.perf_counter() - start
            if len(outputs) == batch and core.scheduler.num_waiting == 0 and all(len(o.new_token_ids) == 1 for o in outputs):
                times.append(elapsed)
        best = min(best, statistics.median(times[2:]) * 1000)
    return best


def int8_projections(model: torch.nn.Module) -> Iterator[Int8QuantizedLinear]:
    """The model's projections on the integer kernel, in module order."""
    for module in model.modules():
        linear = getattr(module, "quantized", None)
        if isinstance(linear, Int8QuantizedLinear):
            yield linear


def use_isa(core: EngineCore, isa: str) -> None:
    """Every integer projection of the model on the kernel's path `isa` (one of quant_cpu.isas())."""
    for linear in int8_projections(core.runner.model):
        linear.isa = ISAS[isa]


def prefill_ms(core: EngineCore, length: int, rounds: int) -> tuple[float, int]:
    """The steps that compute a whole `length`-token prompt and sample its first token: as many
    as the step budget (max_num_batched_tokens) cuts it into, timed together (timing the first
    alone measured a 1,024-token prompt's first 512 tokens); best of `rounds`, and how many steps.
    The prefix cache is emptied before each round: a prompt differing from the rounds' before it is
    not enough, since a longer one would find a shorter one's blocks (the same text), or a decode
    batch's, cached, and its steps would compute only the rest."""
    base = core.tokenizer.encode(PROMPT * (1 + length // 100))
    best, steps = float("inf"), 0
    for r in range(rounds):
        assert core.reset_prefix_cache(), "a request still holds blocks"
        core.add_request(f"p{length}-{r}", base[:length], SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
        start, steps = time.perf_counter(), 0
        while core.has_unfinished():  # max_tokens 1: it ends with the step that samples its first token
            core.step()
            steps += 1
        best = min(best, (time.perf_counter() - start) * 1000)
    return best, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--num-kv-blocks", type=int, default=1024,
                        help="of 16 tokens; a batch whose contexts do not fit is preempted and never all decodes")
    parser.add_argument("--distinct-prompts", action="store_true",
                        help="requests differ in their first token, not their last: no two share a cache "
                             "block, so each step reads every request's whole context")
    parser.add_argument("--output-len", type=int, default=40)
    parser.add_argument("--prefill-lens", type=int, nargs="*", default=[])
    parser.add_argument("--busy-process", action="store_true",
                        help="measure beside a process that keeps one core busy (a spinning Python loop)")
    parser.add_argument("--kernel-threads", type=int, default=1, help="threads of the compiled kernels")
    parser.add_argument("--model", help="a model directory or GGUF file (default: the default model)")
    parser.add_argument("--quantized-activations", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--kv-cache-dtype", default="auto", help="EngineArgs.kv_cache_dtype (auto: fp16 here)")
    parser.add_argument("--speculative-config", default="", help="EngineArgs.speculative_config (default: off)")
    parser.add_argument("--kv-events-config", default=None, help="EngineArgs.kv_events_config (default: off)")
    parser.add_argument("--prefix-caching-hash-algo", default="builtin")
    parser.add_argument("--isa", choices=isas(), help="the integer kernel's path (default: the widest)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.busy_process:
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        atexit.register(busy.kill)
    core = EngineCore(EngineArgs(model=args.model, num_kv_blocks=args.num_kv_blocks, kernel_threads=args.kernel_threads,
                                 quantized_activations=args.quantized_activations, kv_cache_dtype=args.kv_cache_dtype,
                                 speculative_config=args.speculative_config, kv_events_config=args.kv_events_config,
                                 prefix_caching_hash_algo=args.prefix_caching_hash_algo))
    if args.isa is not None:
        use_isa(core, args.isa)
    for batch in args.batch_sizes:
        ms = decode_step_ms(core, batch, args.rounds, args.prompt_len, args.output_len, args.distinct_prompts)
        print(f"batch {batch:3d}: decode step {ms:.2f} ms", flush=True)
    for length in args.prefill_lens:
        ms, steps = prefill_ms(core, length, args.rounds)
        print(f"prompt {length:4d}: prefill {ms:.1f} ms in {steps} step(s), {length / ms * 1000:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
