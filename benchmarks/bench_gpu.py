"""The serving benchmark on a GPU, beside the roof that memory bandwidth puts on decoding.

Starts `trillm serve` on the default model's bf16 weights (the CUDA default: the Triton kernels,
CUDA graphs, the engine in a process of its own) and measures it with this project's load
generator (benchmarks/bench_serving.py), then again with the engine in the server's process
(`--no-engine-process`, what the process boundary is worth on this device) and, at c=32 and 128
only, behind four HTTP fronts (`--api-server-count 4`, what more event loops are worth here):
128 prompt / 128 output tokens at concurrency 1, 8, 32 and 128, then 1024-token prompts with
one output token each (their TTFT is the prefill). Beside each level, the decode roof: a decode
step reads every weight once and each request's KV cache, so at batch c it makes at most
c x bandwidth / (weight bytes + c x KV bytes per request) tokens a second, with the bandwidth a
device-to-device copy measures here. Then the engine alone on the same device and weights
(`EngineCore` stepped by hand, as benchmarks/bench_offline.py does: 128-token prompts, 128 tokens
each, prefill included) at the served levels' batches, so that each served level is also a share
of what its own engine makes offline, with drafting as served and without it (what drafting is
worth at each batch on this device). Where py-spy came with the check, it samples the server's
threads at the last level (pyspy-c128.txt: where the host's time goes). Writes everything to
OUT/<device name>/gpu_bench.json and prints a table for benchmarks/README.md.

    python -m benchmarks.bench_gpu --out gpu-results       (scripts/gpu_check.py bench runs it)
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import trio

from benchmarks.bench_offline import run_batch
from benchmarks.bench_serving import BenchConfig, format_summary, run_benchmark
from benchmarks import neutral_compare

LEVELS = [1, 8, 32, 128]
FRONTS_LEVELS = [32, 128]  # the levels issue 49's served / offline ratio names
PROFILE_S = 8  # seconds py-spy samples the server at the last level
PREFILL_LEN = 1024


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Bytes a second a device-to-device copy moves (each byte read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * nbytes * repeats / (start.elapsed_time(end) / 1e3)


def model_bytes() -> tuple[int, int]:
    """The default model's weights in bf16 bytes (tied embeddings stored once), and its bf16 KV
    cache bytes per token, from its GGUF file's tensor table and metadata."""
    from trillm.model import gguf_model
    from trillm.model.gguf_file import GGUFFile
    from trillm.model.llama import head_dim_of
    from trillm.model.loader import default_model_path

    with GGUFFile(default_model_path()) as file:
        params = sum(math.prod(info.shape) for info in file.tensors.values())
        config = gguf_model.hf_config(file)
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim_of(config) * 2
    return 2 * params, kv_per_token


def decode_roof(bandwidth: float, weights: int, kv_per_token: int, concurrency: int, context: int) -> float:
    """Tokens a second a decode step can make at most, reading the weights and c requests' KV."""
    return concurrency * bandwidth / (weights + concurrency * context * kv_per_token)


def served(out: Path, name: str, flags: list[str], startup_timeout: float, levels: list[int] = LEVELS,
           prefill: bool = True) -> tuple[float, dict]:
    """`trillm serve` at its CUDA defaults (and `flags`) measured at `levels` (and a prefill):
    seconds to ready, the runs."""
    out.mkdir(parents=True, exist_ok=True)

    def command(args, model_dir: str, port: int) -> tuple[list[str], None]:
        return [sys.executable, "-m", "trillm", "serve", "--port", str(port), "--dtype", "bfloat16", "--log-level",
                "warning", *flags], None

    timeout = argparse.Namespace(startup_timeout=startup_timeout)
    with neutral_compare.served(command, timeout, "", out / f"{name}.log") as (server, base_url, ready_s):
        return ready_s, measure(base_url, server.pid, out, levels, prefill)


def measure(base_url: str, server_pid: int, out: Path, levels: list[int], prefill: bool) -> dict:
    runs = {}
    for c in levels:
        config = BenchConfig(base_url, num_prompts=max(8, 4 * c), input_len=128, output_len=128, concurrency=c)
        profiler = profile_host_path(server_pid, out / f"pyspy-c{c}.txt") if c == levels[-1] else None
        runs[f"c{c}"] = trio.run(run_benchmark, config)["summary"]
        if profiler is not None:
            profiler.wait()
        print(format_summary(f"c={c}, 128/128", runs[f"c{c}"]), flush=True)
    if not prefill:
        return runs
    config = BenchConfig(base_url, num_prompts=8, input_len=PREFILL_LEN, output_len=1, concurrency=1)
    runs["prefill"] = trio.run(run_benchmark, config)["summary"]
    print(format_summary(f"prefill {PREFILL_LEN}", runs["prefill"]), flush=True)
    return runs


def profile_host_path(pid: int, path: Path) -> subprocess.Popen | None:
    """py-spy sampling the server's threads for PROFILE_S seconds (raw, idle samples kept: the
    loop's waits are the point), where the check brought it; None without it."""
    binary = shutil.which("py-spy")
    if binary is None:
        print("py-spy is not here: the host path goes unprofiled", flush=True)
        return None
    return subprocess.Popen([binary, "record", "-p", str(pid), "-d", str(PROFILE_S), "-r", "250", "-f", "raw",
                             "--threads", "--idle", "--subprocesses", "-o", str(path)], stdout=subprocess.DEVNULL)


def offline(batches: list[int], speculative_config: str | None = None) -> dict:
    """Output tok/s of the engine alone at each batch (128/128, greedy, ignore_eos), on the
    server's weights and defaults (`speculative_config`: other drafting than the default, "" for
    none); a batch of 8 first compiles and captures what it needs."""
    from trillm.config import EngineArgs
    from trillm.engine.core import EngineCore

    rates = {}
    drafting = {} if speculative_config is None else {"speculative_config": speculative_config}
    with EngineCore(EngineArgs(device="cuda", dtype="bfloat16", **drafting)) as core:
        run_batch(core, 8, 128, 8, seed=0, device="cuda")
        for batch in batches:
            run = run_batch(core, batch, 128, 128, seed=batch, device="cuda")
            rates[f"c{batch}"] = batch * 128 / run["total_s"]
            print(f"offline batch {batch}{'' if speculative_config is None else ', drafting off'}: "
                  f"{rates[f'c{batch}']:.0f} output tok/s", flush=True)
    torch.cuda.empty_cache()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-results"))
    parser.add_argument("--startup-timeout", type=float, default=600)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    device = torch.cuda.get_device_name(0)
    out = args.out / re.sub(r"[^A-Za-z0-9.-]+", "-", device).strip("-")
    out.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth()
    weights, kv_per_token = model_bytes()
    torch.cuda.empty_cache()
    ready_s, runs = served(out, "server", [], args.startup_timeout)
    print("the same, the engine in the server's process (--no-engine-process):", flush=True)
    _, runs_together = served(out / "in-server-process", "server", ["--no-engine-process"], args.startup_timeout)
    print("the same, behind four HTTP fronts (--api-server-count 4):", flush=True)
    _, runs_fronts = served(out / "four-fronts", "server", ["--api-server-count", "4"], args.startup_timeout,
                            levels=FRONTS_LEVELS, prefill=False)
    engine = offline(LEVELS)
    undrafted = offline(LEVELS, speculative_config="")  # what drafting is worth per batch on this device
    context = 128 + 128 // 2  # a request's mean context while it decodes
    roofs = {f"c{c}": decode_roof(bandwidth, weights, kv_per_token, c, context) for c in LEVELS}
    result = {"device": device, "copy_bandwidth_gb_s": bandwidth / 1e9, "weight_bytes": weights,
              "kv_bytes_per_token": kv_per_token, "startup_s": ready_s, "runs": runs, "decode_roof_tok_s": roofs,
              "offline_tok_s": engine, "offline_without_drafting_tok_s": undrafted,
              "runs_engine_in_server_process": runs_together, "runs_four_fronts": runs_fronts}
    (out / "gpu_bench.json").write_text(json.dumps(result, indent=1))
    print(f"\n{device}: copy bandwidth {bandwidth / 1e9:.0f} GB/s, bf16 weights {weights / 2**20:.0f} MiB")
    print("| c | output tok/s | offline engine tok/s | served / offline | engine in the server's process: "
          "tok/s (served / offline) | offline, no drafting | decode roof tok/s | share of roof | TTFT mean ms "
          "| TPOT mean ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in LEVELS:
        s, offline_rate = runs[f"c{c}"], engine[f"c{c}"]
        rate, together = s["output_throughput"], runs_together[f"c{c}"]["output_throughput"]
        print(f"| {c} | {rate:.0f} | {offline_rate:.0f} | {rate / offline_rate:.2f} | "
              f"{together:.0f} ({together / offline_rate:.2f}) | {undrafted[f'c{c}']:.0f} | {roofs[f'c{c}']:.0f} | "
              f"{rate / roofs[f'c{c}']:.2f} | {s['ttft_ms']['mean']:.1f} | {s['tpot_ms']['mean']:.2f} |")
    print(f"prefill of {PREFILL_LEN} tokens: TTFT mean {runs['prefill']['ttft_ms']['mean']:.1f} ms")
    for c in FRONTS_LEVELS:
        rate = runs_fronts[f"c{c}"]["output_throughput"]
        print(f"four fronts, c={c}: {rate:.0f} tok/s ({rate / engine[f'c{c}']:.2f} of the offline engine)")


if __name__ == "__main__":
    main()
