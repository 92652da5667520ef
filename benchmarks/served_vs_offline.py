"""A model on this machine's CPU (the default one unless --model), served as a share of its own
engine's rate: the engine stepped alone (`EngineCore`, greedy, 128/128, the load generator's own
prompts, a batch of c), then `trillm serve` measured by this project's load generator
(benchmarks/bench_serving.py) at concurrency c, with the engine in the server's process, in its
own (`--engine-process`), and in its own behind two HTTP fronts (`--api-server-count 2`). The CPU
side of what bench_gpu.py's served / offline column says on a GPU. Drafting is off in all:
served waves of greedy random prompts fill the suffix cache that a lone batch starts without, and
the share would measure that instead of the host's part.

    python -m benchmarks.served_vs_offline --levels 8 32 --out benchmarks/results/served_vs_offline.json
    python -m benchmarks.served_vs_offline --model tests/data/gguf/tiny-Q4_K_M.gguf --levels 8 128 --out ...
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import trio

from benchmarks.bench_offline import run_batch
from benchmarks.bench_serving import BenchConfig, random_prompts, run_benchmark
from benchmarks import neutral_compare

LINKS = {"in the server's process": ["--no-engine-process"], "own process": ["--engine-process"],
         "own process, two fronts": ["--api-server-count", "2"]}
NO_DRAFTS = ["--speculative-config", ""]


def config(base_url: str, concurrency: int, token_range: tuple[int, int] | None) -> BenchConfig:
    return BenchConfig(base_url, num_prompts=4 * concurrency, concurrency=concurrency, input_len=128, output_len=128,
                       **({} if token_range is None else {"token_range": token_range}))


def offline(model: str | None, levels: list[int], token_range) -> dict[int, float]:
    """Output tok/s of the engine alone at each batch, on the first batch of the load's prompts."""
    from trillm.config import EngineArgs
    from trillm.engine.core import EngineCore

    rates = {}
    with EngineCore(EngineArgs(model=model, speculative_config="")) as core:
        for c in levels:
            prompts = random_prompts(config("", c, token_range))[:c]
            run = run_batch(core, c, 128, 128, seed=c, device="cpu", prompts=prompts)
            rates[c] = c * 128 / run["total_s"]
            print(f"offline batch {c}: {rates[c]:.1f} output tok/s", flush=True)
    return rates


def served(model: str | None, flags: list[str], levels: list[int], token_range, log: Path) -> dict[int, float]:
    model_flags = [] if model is None else ["--model", model]

    def command(args, model_dir: str, port: int) -> tuple[list[str], None]:
        return [sys.executable, "-m", "trillm", "serve", "--port", str(port), *model_flags, *NO_DRAFTS, *flags], None

    with neutral_compare.served(command, argparse.Namespace(startup_timeout=300), "", log) as (_, base_url, _):
        return {c: trio.run(run_benchmark, config(base_url, c, token_range))["summary"]["output_throughput"]
                for c in levels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF file (default: the default model)")
    parser.add_argument("--token-range", type=int, nargs=2, metavar=("LO", "HI"),
                        help="the prompts' token ids (bench_serving's; a tiny vocabulary needs it)")
    parser.add_argument("--levels", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/served_vs_offline.json"))
    args = parser.parse_args()
    token_range = None if args.token_range is None else tuple(args.token_range)
    engine = offline(args.model, args.levels, token_range)
    rates = {}
    for name, flags in LINKS.items():
        rates[name] = served(args.model, flags, args.levels, token_range,
                             args.out.with_suffix(f".{flags[0][2:]}.log"))
    args.out.write_text(json.dumps({"offline": engine, "served": rates}, indent=1))
    print("| c | engine alone tok/s | " + " | ".join(f"{n}: tok/s (share)" for n in LINKS) + " |")
    print("|---:|---:|" + "---:|" * len(LINKS))
    for c in args.levels:
        print(f"| {c} | {engine[c]:.0f} | " + " | ".join(f"{rates[n][c]:.0f} ({rates[n][c] / engine[c]:.2f})"
                                                        for n in LINKS) + " |")


if __name__ == "__main__":
    main()
