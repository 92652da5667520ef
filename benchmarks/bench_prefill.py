"""A lone prompt to its first token, as the engine computes it: `EngineCore` directly on the
default model at the server's defaults (the kernels on every core, the default budgets), one
prompt of each --lens of random token ids (so no prefix-cache hit), `max_tokens` 1, timed from
add_request to the request's end; with the number of steps its prefill took.

    PYTHONPATH=. python benchmarks/bench_prefill.py --lens 1000 4096 7000 --json out.json

For comparing two versions of the engine: run it from each checkout in turn (PYTHONPATH=. in
the checkout), alternated.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import time

from trillm import SamplingParams
from trillm.config import EngineArgs
from trillm.engine.core import EngineCore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lens", type=int, nargs="+", default=[1000, 4096, 7000])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="append the results here, one JSON line")
    args = parser.parse_args()
    core = EngineCore(EngineArgs(num_kv_blocks=1024, max_model_len=8192))
    rng = random.Random(args.seed)
    core.add_request("warm-up", [rng.randrange(1000, 30000) for _ in range(64)], SamplingParams(max_tokens=1))
    while core.has_unfinished():
        core.step()
    results = []
    for length in args.lens:
        core.add_request(f"prompt-{length}", [rng.randrange(1000, 30000) for _ in range(length)],
                         SamplingParams(max_tokens=1, temperature=0))
        start, steps = time.perf_counter(), 0
        while core.has_unfinished():
            core.step()
            steps += 1
        seconds = time.perf_counter() - start
        results.append({"tokens": length, "seconds": seconds, "ms_per_token": seconds / length * 1e3, "steps": steps})
        print(f"{length:5d} tokens: {seconds:6.2f} s, {seconds / length * 1e3:.3f} ms a token, {steps} steps",
              flush=True)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "a") as f:
            f.write(json.dumps({"commit": commit, "results": results}) + "\n")


if __name__ == "__main__":
    main()
