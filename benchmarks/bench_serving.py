"""Serving benchmark: an async load generator for any OpenAI-compatible server.

Streams `/v1/completions` (prompts as token ids, so every server sees exactly `--input-len`
tokens) or `/v1/chat/completions` (prompts as text, decoded from the same random ids with
`--tokenizer`), with `ignore_eos` and `max_tokens = --output-len`, so every request produces
exactly that many tokens whatever the model says. Requests start as fast as a concurrency cap
allows, or as a Poisson process at `--request-rate` (still under the cap). Reports request
throughput, output tokens/s, TTFT, TPOT and ITL (mean, median, p99), the prompt tokens the
server says it found in its prefix cache, and writes JSON. `--shared-prefix-len N` makes a
shared-prefix load: every prompt starts with the same N tokens, as requests under one long
system prompt do.

    python -m benchmarks.bench_serving --base-url http://127.0.0.1:8000 --concurrency 8 \
        --num-prompts 32 --input-len 128 --output-len 128 --json out.json

Definitions (as vLLM's benchmark has them, except that a chunk counts only when it carries text,
so a role-only first chat chunk does not pass for a first token):
  TTFT  request start -> first chunk with text;
  ITL   the gaps between successive chunks with text;
  TPOT  (latency - TTFT) / (output tokens - 1), per request; output tokens from the usage chunk.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx
import trio


@dataclass
class BenchConfig:
    base_url: str
    model: str | None = None  # None: the first model /v1/models lists
    endpoint: str = "completions"  # completions | chat
    num_prompts: int = 32
    input_len: int = 128
    output_len: int = 128
    concurrency: int = 8
    request_rate: float = math.inf  # requests/s of a Poisson process; inf: all at once (capped)
    seed: int = 0
    token_range: tuple[int, int] = (1000, 30000)  # prompt token ids are drawn from [lo, hi)
    shared_prefix_len: int = 0  # the first tokens of every prompt, the same for all (a system prompt)
    tokenizer: str | None = None  # an HF tokenizer directory; needed for the chat endpoint
    warmup: int = 1  # untimed requests first, one at a time
    timeout: float = 600.0


@dataclass
class RequestResult:
    ok: bool
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache, where it says
    itl: list[float] = field(default_factory=list)
    error: str = ""


def random_prompts(config: BenchConfig) -> list[list[int]]:
    """The same seed gives the same prompts, so two servers measured one after the other see the same load.
    Each is `input_len` tokens: the shared prefix (`shared_prefix_len`, the same for every prompt), then
    its own random tokens."""
    assert 0 <= config.shared_prefix_len <= config.input_len
    rng = random.Random(config.seed)
    lo, hi = config.token_range
    prefix = [rng.randrange(lo, hi) for _ in range(config.shared_prefix_len)]
    own = config.input_len - config.shared_prefix_len
    return [prefix + [rng.randrange(lo, hi) for _ in range(own)] for _ in range(config.num_prompts)]


def request_body(config: BenchConfig, model: str, prompt: list[int], decode) -> tuple[str, dict]:
    common = {
        "model": model,
        "max_tokens": config.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "completions":
        return "/v1/completions", {**common, "prompt": prompt}
    assert config.endpoint == "chat", config.endpoint
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": decode(prompt)}]}


def chunk_text(config: BenchConfig, choice: dict) -> str:
    if config.endpoint == "completions":
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


async def send_one(client: httpx.AsyncClient, config: BenchConfig, path: str, body: dict) -> RequestResult:
    result = RequestResult(ok=False, start=time.perf_counter())
    last = None
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
                if any(chunk_text(config, choice) for choice in chunk.get("choices") or []):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - result.start
        result.ok = last is not None and result.output_tokens > 0
        if not result.ok:
            result.error = "no text or no usage in the stream"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        result.error = repr(exc)
    return result


def percentiles(values: list[float], scale: float = 1e3) -> dict:
    """mean, median and p99 (nearest rank), in ms by default."""
    if not values:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"mean": statistics.fmean(values) * scale, "median": statistics.median(values) * scale, "p99": p99 * scale}


def summarize(config: BenchConfig, results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": output_tokens,
        "total_cached_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "ttft_ms": percentiles([r.ttft for r in done]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([gap for r in done for gap in r.itl]),
        "e2e_latency_ms": percentiles([r.latency for r in done]),
    }


async def first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run_benchmark(config: BenchConfig) -> dict:
    """One run against config.base_url; returns {"config", "summary", "requests"}."""
    decode = None
    if config.endpoint == "chat":
        assert config.tokenizer, "the chat endpoint needs --tokenizer to turn the random ids into text"
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(f"{config.tokenizer}/tokenizer.json")
        decode = tokenizer.decode
    limits = httpx.Limits(max_connections=config.concurrency + 1, max_keepalive_connections=config.concurrency + 1)
    async with httpx.AsyncClient(base_url=config.base_url, timeout=config.timeout, limits=limits) as client:
        model = config.model or await first_model(client)
        prompts = random_prompts(config)
        bodies = [request_body(config, model, prompt, decode) for prompt in prompts]
        for i in range(config.warmup):
            warm = await send_one(client, config, *bodies[i % len(bodies)])
            assert warm.ok, f"warm-up request failed: {warm.error}"
        results: list[RequestResult] = [RequestResult(ok=False)] * len(bodies)
        limiter = trio.Semaphore(config.concurrency)
        rng = random.Random(config.seed + 1)

        async def one(i: int) -> None:
            async with limiter:
                results[i] = await send_one(client, config, *bodies[i])

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(len(bodies)):
                if math.isfinite(config.request_rate) and i:
                    await trio.sleep(rng.expovariate(config.request_rate))
                await limiter.acquire()  # start no task that would only wait on the cap
                limiter.release()
                nursery.start_soon(one, i)
        duration = time.perf_counter() - start
    config_out = {**asdict(config), "model": model}
    return {"config": config_out, "summary": summarize(config, results, duration), "requests": [asdict(r) for r in results]}


def format_summary(label: str, summary: dict) -> str:
    lines = [
        f"== {label}: {summary['completed']} ok, {summary['failed']} failed in {summary['duration_s']:.1f} s",
        f"   request throughput {summary['request_throughput']:.2f} req/s, "
        f"output {summary['output_throughput']:.1f} tok/s, "
        f"{summary['total_cached_tokens']} of {summary['total_input_tokens']} prompt tokens cached",
    ]
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        p = summary[name]
        lines.append(f"   {name[:-3].upper():<5} mean {p['mean']:8.1f}  median {p['median']:8.1f}  p99 {p['p99']:8.1f} ms")
    if summary["errors"]:
        lines.append(f"   errors: {summary['errors']}")
    return "\n".join(lines)


def parse_args(argv=None) -> tuple[BenchConfig, str | None]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None)
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-range", type=int, nargs=2, default=[1000, 30000], metavar=("LO", "HI"))
    parser.add_argument("--shared-prefix-len", type=int, default=0,
                        help="a prefix every prompt shares, within --input-len (a long system prompt)")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer directory (for --endpoint chat)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", default=None, help="write config, summary and per-request results here")
    args = parser.parse_args(argv)
    config = BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, concurrency=args.concurrency,
        request_rate=args.request_rate, seed=args.seed, token_range=tuple(args.token_range),
        tokenizer=args.tokenizer, warmup=args.warmup, shared_prefix_len=args.shared_prefix_len,
    )
    return config, args.json


def main(argv=None) -> None:
    config, json_path = parse_args(argv)
    report = trio.run(run_benchmark, config)
    print(format_summary(f"{config.base_url} {config.endpoint} c={config.concurrency}", report["summary"]))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
