"""What compiling the scheduler buys: one schedule() + update() step, compiled vs
the very same .pyx source run as plain Python.

The workload is the decode steady state that dominates serving: N running
requests, each computing one token per step, a new block every block_size steps,
and the prefix cache taking each block as it fills. The pool is sized so that
nothing is preempted or finishes while timing.

    python -m benchmarks.bench_scheduler [--sizes 64 256 1024] [--steps 64] [--repeats 5]
"""
import argparse
import random
import time
from types import ModuleType

from trillm.sched_ext import allocator, load_uncompiled, scheduler

PROMPT_LEN = 128
BLOCK_SIZE = 16


def prefill(module: ModuleType, num_requests: int, num_steps: int):
    """Run the prompts through, so that every request decodes from here on, with
    room in the pool and in max_tokens for `num_steps` more steps."""
    rng = random.Random(0)
    budget = 2048 + num_requests  # decodes take at most num_requests; 2048 go to prompts
    max_len = PROMPT_LEN + -(-num_requests * PROMPT_LEN // 2048) + num_steps + 2
    sched = module.Scheduler(num_requests * -(-max_len // BLOCK_SIZE), BLOCK_SIZE,
                             max_num_batched_tokens=budget, max_num_seqs=num_requests, max_model_len=max_len + 1)
    for i in range(num_requests):
        prompt = [rng.randrange(1, 50_000) for _ in range(PROMPT_LEN)]
        sched.add(module.Request(f"r{i}", prompt, max_len, ignore_eos=True))
    while True:
        out = sched.schedule()
        sched.update(out, [7] * len(out.scheduled))
        if sched.num_waiting == 0 and out.num_decodes == num_requests:
            return sched


def time_steps(module: ModuleType, num_requests: int, num_steps: int, repeats: int) -> float:
    """Seconds per step: the mean over `num_steps` steps, the best of `repeats` runs
    (the least disturbed by whatever else the machine is doing)."""
    runs = []
    for _ in range(repeats):
        sched = prefill(module, num_requests, num_steps)
        sampled = [7] * num_requests
        start = time.perf_counter()
        for _ in range(num_steps):
            out = sched.schedule()
            sched.update(out, sampled)
        runs.append((time.perf_counter() - start) / num_steps)
        assert out.num_decodes == num_requests and not out.preempted and sched.num_running == num_requests
    return min(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per run")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    assert allocator.COMPILED and scheduler.COMPILED, "the compiled extensions are not the ones imported"
    _, uncompiled = load_uncompiled()
    print(f"one schedule() + update() in decode steady state; best of {args.repeats} runs "
          f"of {args.steps} steps")
    print(f"{'running':>8} {'compiled':>12} {'plain Python':>14} {'speed-up':>9}")
    for n in args.sizes:
        fast = time_steps(scheduler, n, args.steps, args.repeats)
        slow = time_steps(uncompiled, n, args.steps, args.repeats)
        print(f"{n:>8} {fast * 1e6:>9.1f} us {slow * 1e6:>11.1f} us {slow / fast:>8.1f}x")


if __name__ == "__main__":
    main()
