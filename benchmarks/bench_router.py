"""Data parallelism: what vllm-router adds per request, and its policies on a shared-prefix load
(cache_aware's tree of the text it routed, kv_aware's index of the blocks the replicas' KV-cache
events report, round_robin), with `trillm serve --data-parallel-size 2`.

For each policy (in --order), the server is started, then:
  1. router latency: --latency-requests one-token completions, one at a time, sent straight to
     replica 0 and through the router, alternating; the difference of the medians is what the
     router adds to a request;
  2. the load, from the neutral generator: `vllm bench serve --dataset-name prefix_repetition`
     (--num-prefixes prefixes of --prefix-len tokens, each followed by --suffix-len tokens of its
     own), through the router; its throughput, and the prefix-cache hit rate the replicas'
     /metrics count over the run (hits / queries, summed over the replicas), and how the
     requests split between the replicas.

    python -m benchmarks.bench_router --out benchmarks/results/router_vllm_router.json
    python -m benchmarks.bench_router --order round_robin kv_aware cache_aware \
        --out benchmarks/results/router_vllm_router_swapped.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.compare_peer import REPO, free_port, stop

SERVED_NAME = "SmolLM2-135M-Instruct"


def start(policy: str, port: int, log_path: Path, kv_blocks: int) -> tuple[subprocess.Popen, list[str]]:
    """The supervisor, once the router answers; and the replicas' URLs, from its log."""
    log = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "trillm", "serve", "--data-parallel-size", "2", "--router-policy", policy,
         "--port", str(port), "--num-kv-blocks", str(kv_blocks)],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        text = log_path.read_text()
        if "behind vllm-router" in text:
            return process, re.findall(r"replica \d \(pid \d+\): (http://\S+)", text)
        if process.poll() is not None:
            raise RuntimeError(f"the server exited; its log ends:\n{text[-3000:]}")
        time.sleep(0.2)
    raise TimeoutError("the server did not start")


def median_latency(url: str, count: int) -> float:
    body = {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 1}
    times = []
    with httpx.Client(base_url=url, timeout=60) as http:
        http.post("/v1/completions", json=body)  # the connection, warm
        for _ in range(count):
            start = time.perf_counter()
            http.post("/v1/completions", json=body).raise_for_status()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def cache_counts(urls: list[str]) -> list[dict]:
    counts = []
    for url in urls:
        text = httpx.get(url + "/metrics").text
        value = {name: float(re.search(rf"^trillm:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M).group(1))
                 for name in ("prefix_cache_hits", "prefix_cache_queries", "prompt_tokens")}
        value["requests"] = sum(float(v) for v in re.findall(r"^trillm:request_success_total\{[^}]*\} (\S+)$",
                                                               text, re.M))
        counts.append(value)
    return counts


def bench_serve(args, base_url: str, result: Path) -> dict:
    from trillm.model.conversion import tokenizer_dir

    vllm = Path(args.vllm_venv) / "bin" / "vllm"
    command = [
        str(vllm), "bench", "serve", "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", SERVED_NAME, "--tokenizer", tokenizer_dir(None), "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_len), "--prefix-repetition-suffix-len", str(args.suffix_len),
        "--prefix-repetition-num-prefixes", str(args.num_prefixes), "--prefix-repetition-output-len",
        str(args.output_len), "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
        "--ignore-eos", "--seed", str(args.seed), "--save-result", "--result-dir", str(result.parent),
        "--result-filename", result.name,
    ]
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "VLLM_TARGET_DEVICE": "cpu"}
    subprocess.run(command, env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return json.loads(result.read_text())


def measure(policy: str, args, work: Path) -> dict:
    port = free_port()
    process, replicas = start(policy, port, work / f"{policy}.log", args.kv_blocks)
    router = f"http://127.0.0.1:{port}"
    try:
        direct, routed = [], []
        for _ in range(args.latency_rounds):
            direct.append(median_latency(replicas[0], args.latency_requests))
            routed.append(median_latency(router, args.latency_requests))
        before = cache_counts(replicas)
        report = bench_serve(args, router, work / f"{policy}.json")
        after = cache_counts(replicas)
    finally:
        stop(process)
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    return {
        "direct_median_s": statistics.median(direct),
        "routed_median_s": statistics.median(routed),
        "router_adds_ms": 1000 * (statistics.median(routed) - statistics.median(direct)),
        "output_throughput": report["output_throughput"],
        "request_throughput": report["request_throughput"],
        "mean_ttft_ms": report["mean_ttft_ms"],
        "hit_rate": sum(d["prefix_cache_hits"] for d in delta) / max(sum(d["prefix_cache_queries"] for d in delta), 1),
        "requests_per_replica": [d["requests"] for d in delta],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--order", nargs="+", default=["cache_aware", "kv_aware", "round_robin"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=96, help="per replica: room for about 2 prefixes")
    parser.add_argument("--latency-requests", type=int, default=30)
    parser.add_argument("--latency-rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-venv", default=str(REPO / ".peers" / "vllm"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for policy in args.order:
            results[policy] = measure(policy, args, Path(work))
            print(policy, json.dumps(results[policy]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"config": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
