"""The reliability tests, longer: soak rounds of many concurrent streams (a third disconnecting,
a third aborted) and a bigger fuzz of every POST route, against one live server on 127.0.0.1.
Prints the figures docs/reliability.md quotes; exits non-zero on the first broken invariant.

    PYTHONPATH=. python benchmarks/soak.py --requests 600 --rounds 2 --fuzz-examples 100

The model is the tests' tiny random llama (2 layers, hidden 64) with SmolLM2's tokenizer, its
weights random (`--load-format dummy`), so the serving path, not the model, is what runs.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

import conftest  # noqa: E402  (sets the test environment: one torch thread, no hub)
import trio  # noqa: E402
from fuzz_support import fuzz_in_a_process, probe_health  # noqa: E402
from http_support import live_server  # noqa: E402
from soak_support import check_no_leaks, run_soak  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from trillm.config import EngineArgs  # noqa: E402
from trillm.engine.core import EngineCore  # noqa: E402
from trillm.model.conversion import tokenizer_dir  # noqa: E402


def tiny_text_model(directory: str) -> str:
    """conftest's tiny llama config with SmolLM2's vocabulary and tokenizer; weights come dummy."""
    config = AutoConfig.for_model("llama", **{**conftest.TINY_BASE, **conftest.TINY_CONFIGS["llama"], "vocab_size": 49152})
    config.save_pretrained(directory)
    default = tokenizer_dir(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(default, name)):
            shutil.copy(os.path.join(default, name), directory)
    return directory


async def main(args) -> None:
    with tempfile.TemporaryDirectory() as directory:
        core = EngineCore(EngineArgs(
            model=tiny_text_model(directory), load_format="dummy", num_kv_blocks=args.kv_blocks, max_model_len=96,
        ))
    totals = dict(requests=0, completed=0, disconnected=0, aborted=0, abort_races=0, tokens=0, fivexx=0, leaked=0)
    async with live_server(core) as server:
        for round_ in range(args.rounds):
            report = await run_soak(server, args.requests, seed=round_)
            await check_no_leaks(server, report)
            print(f"round {round_}: {report.summary()}", flush=True)
            for key, value in (("requests", report.num_requests), ("completed", report.num_completed),
                               ("disconnected", report.num_disconnected), ("aborted", report.num_aborted),
                               ("abort_races", report.num_abort_races), ("tokens", report.num_tokens),
                               ("fivexx", report.num_5xx), ("leaked", report.blocks_leaked)):
                totals[key] += value
        http = server.http()
        probes: list[float] = []
        async with trio.open_nursery() as nursery:  # the loop must answer /health throughout
            nursery.start_soon(probe_health, server.url, probes)
            counts = await fuzz_in_a_process(server.url, args.fuzz_examples)
            nursery.cancel_scope.cancel()
        assert (await http.get("/health")).status_code == 200
    print(f"soak total: {totals}")
    print(f"fuzz: {sum(counts.values())} cases, by status class {dict(sorted(counts.items()))} (5xx: {counts.get(5, 0)}); "
          f"{len(probes)} /health probes meanwhile, slowest {max(probes):.3f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=600, help="concurrent streams per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fuzz-examples", type=int, default=100, help="per POST route and per valid/invalid")
    parser.add_argument("--kv-blocks", type=int, default=128, help="KV pool (16-token blocks); small forces preemption")
    trio.run(main, parser.parse_args())
