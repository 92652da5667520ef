"""Speculative decoding measured by the neutral load generator: `vllm bench serve` drives trillm
without drafts (`--speculative-config ""`) and with n-gram or suffix drafts (suffix: its default;
-cap4: with the fixed `disable_by_batch_size` 4 the measured policy replaced), and llama-server
without and with its own n-gram drafts (`--spec-type ngram-simple`, its defaults otherwise), one
server at a time on a free loopback port, on

- the repetitive workload (benchmarks/repetitive_workload.py: code edits, extraction that
  quotes its input, an agent's repeated tool calls; greedy, each request to its natural end or
  its output_tokens) at each --concurrency level, and
- the plain random 128/128 load (ignore_eos) at each --random-concurrency level, where drafting
  must cost nothing.

Every request is greedy unless --temperature says otherwise (sampled output drafts less).

Prints each server's output throughput (mean TTFT, mean TPOT, tokens produced) per load and
writes the raw reports beside --out.

    python -m benchmarks.bench_speculative --out benchmarks/results/speculative-run1.json
    python -m benchmarks.bench_speculative --order llama-server-ngram llama-server trillm-ngram trillm \\
        --out benchmarks/results/speculative-run2.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.compare_peer import REPO, trillm_command
from benchmarks.neutral_compare import SERVED_NAME, llama_server_command, served

WORKLOAD = REPO / "benchmarks" / "data" / "repetitive.jsonl"
# Each method at the draft length that served it best offline (the commit bodies have the sweep)
SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SUFFIX_CONFIG = {"method": "suffix", "num_speculative_tokens": 6}


def trillm_drafting(config: dict | None):
    """trillm serving with `config` as its --speculative-config (None: no drafts)."""
    def command(args, model_dir: str, port: int):
        command, env = trillm_command(args, model_dir, port)
        return command + ["--speculative-config", "" if config is None else json.dumps(config)], env
    return command


def llama_ngram_command(args, model_dir: str, port: int):
    command, env = llama_server_command(args, model_dir, port)
    return command + ["--spec-type", "ngram-simple"], env


# trillm-suffix: drafting where it measures faster (the default); -cap4: the fixed rule it replaced
SERVERS = {"trillm": trillm_drafting(None), "trillm-ngram": trillm_drafting(SPEC_CONFIG),
           "trillm-suffix": trillm_drafting(SUFFIX_CONFIG),
           "trillm-suffix-cap4": trillm_drafting({**SUFFIX_CONFIG, "disable_by_batch_size": 4}),
           "llama-server": llama_server_command, "llama-server-ngram": llama_ngram_command}


def bench_serve(args, model_dir: str, base_url: str, load: list[str], concurrency: int, result: Path) -> dict:
    vllm = Path(args.vllm_venv) / "bin" / "vllm"
    command = [
        str(vllm), "bench", "serve", "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", SERVED_NAME, "--tokenizer", model_dir, *load, "--max-concurrency", str(concurrency),
        "--temperature", str(args.temperature), "--num-warmups", "1", "--seed", "0",
        "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
    ]
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "VLLM_TARGET_DEVICE": "cpu"}
    subprocess.run(command, env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return json.loads(result.read_text())


def loads(args) -> list[tuple[str, list[str], int]]:
    """(name, the load's `vllm bench serve` arguments, concurrency) for every measurement."""
    repetitive = ["--dataset-name", "custom", "--dataset-path", str(WORKLOAD)]
    out = [(f"repetitive c={c}", repetitive + ["--num-prompts", str(max(c, 11))], c) for c in args.concurrency]
    for c in args.random_concurrency:
        random = ["--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "128",
                  "--random-range-ratio", "0", "--ignore-eos", "--num-prompts", str(max(2 * c, 8))]
        out.append((f"random c={c}", random, c))
    return out


def spec_counters(base_url: str) -> dict[str, float]:
    """trillm's speculative-decoding counters from /metrics (per position: `..._per_pos_total{j}`)."""
    counters = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
        for sample in family.samples:
            if sample.name.startswith("trillm:spec_decode_") and sample.name.endswith("_total"):
                position = sample.labels.get("position")
                counters[sample.name.removeprefix("trillm:") + ("" if position is None else f"[{position}]")] = \
                    sample.value
    return counters


def measure(name: str, args, model_dir: str, out_dir: Path) -> dict:
    results = {}
    with served(SERVERS[name], args, model_dir, out_dir / f"{name}.log") as (_, base_url, _):
        for load_name, load, c in loads(args):
            if name.startswith("llama-server") and load_name.startswith("random"):
                continue  # the peer's random-load figures are the neutral runs'
            slug = load_name.replace(" ", "-").replace("=", "")
            before = spec_counters(base_url) if name.startswith("trillm") else {}
            r = bench_serve(args, model_dir, base_url, load, c, out_dir / f"{name}-{slug}.json")
            results[load_name] = {k: r[k] for k in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms",
                                                     "total_output_tokens", "completed")}
            if name.startswith("trillm"):  # the load's drafts (the warm-up's included)
                after = spec_counters(base_url)
                results[load_name]["spec_decode"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
            print(f"{name} {load_name}: {r['output_throughput']:.1f} tok/s, TTFT {r['mean_ttft_ms']:.0f} ms, "
                  f"TPOT {r['mean_tpot_ms']:.1f} ms, {r['total_output_tokens']} tokens", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--order", nargs="+", default=list(SERVERS), choices=list(SERVERS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--random-concurrency", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--vllm-venv", default=".peers/vllm")
    parser.add_argument("--llama-dir", default=".peers/llama.cpp")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    parser.add_argument("--out", default="benchmarks/results/speculative.json")
    args = parser.parse_args()
    args.dtype, args.num_threads, args.trillm_dense = None, 1, False  # what trillm_command reads: its defaults

    from trillm.model.conversion import hf_directory
    from trillm.model.loader import default_model_path

    model_dir = hf_directory(default_model_path())  # the peers' copy of the file (vLLM reads no GGUF here)
    out = Path(args.out)
    raw = out.with_suffix("")
    raw.mkdir(parents=True, exist_ok=True)
    results = {"args": vars(args), "spec_config": SPEC_CONFIG, "suffix_config": SUFFIX_CONFIG}
    for name in args.order:
        results[name] = measure(name, args, model_dir, raw)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
