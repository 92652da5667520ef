"""One long prompt beside decoding streams: how long the streams wait between tokens while it is
prefilled, and how long the prompt waits for its first token.

Against a running server (any OpenAI-compatible one): `--streams` clients stream completions of
`--stream-tokens` tokens each, over and over; once they are all decoding, one client sends a
`--long-len`-token prompt (random token ids, so every server sees exactly that many) for one
token. The streams' inter-token gaps are kept from the long prompt's send to its answer: their
p50, p99 and max say what a neighbour suffers; the long prompt's TTFT is what it costs itself.

    python benchmarks/bench_long_prompt.py --base-url http://127.0.0.1:8000 --long-len 4000 \
        --streams 8 --json benchmarks/results/long_prompt.json

`--retry-timeout S` measures resuming instead: the long prompt is sent with a client timeout of S
seconds (shorter than its prefill), and sent again after each time-out, until it is answered;
the JSON lists each attempt's cached prompt tokens (from the server's usage, where it answers).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics

import httpx
import trio


async def first_model(client: httpx.AsyncClient) -> str:
    return (await client.get("/v1/models")).json()["data"][0]["id"]


async def run(args) -> dict:
    random.seed(args.seed)
    long_prompt = [random.randrange(1000, 30000) for _ in range(args.long_len)]
    gaps: list[float] = []
    measuring = [False]
    done = trio.Event()
    decoding = [0]
    async with httpx.AsyncClient(base_url=args.base_url, timeout=600) as client:
        model = args.model or await first_model(client)

        async def stream(k: int) -> None:
            body = {"model": model, "prompt": [random.randrange(1000, 30000) for _ in range(32)],
                    "max_tokens": args.stream_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
            counted = False
            while not done.is_set():
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    last = None
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        now = trio.current_time()
                        if last is not None and measuring[0]:
                            gaps.append(now - last)
                        last = now
                        if not counted:
                            counted = True
                            decoding[0] += 1
                        if done.is_set():
                            break

        result: dict = {"model": model, "long_len": args.long_len, "streams": args.streams}
        async with trio.open_nursery() as nursery:
            for k in range(args.streams):
                nursery.start_soon(stream, k)
            while decoding[0] < args.streams:
                await trio.sleep(0.05)
            await trio.sleep(1.0)
            measuring[0] = True
            body = {"model": model, "prompt": long_prompt, "max_tokens": 1, "ignore_eos": True, "temperature": 0}
            attempts = []
            start = trio.current_time()
            while True:
                try:
                    timeout = args.retry_timeout or 3600
                    response = await client.post("/v1/completions", json=body, timeout=timeout)
                    usage = response.json()["usage"]
                    attempts.append({"answered": True, "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]})
                    break
                except httpx.TimeoutException:
                    attempts.append({"answered": False})
                    if len(attempts) >= args.max_attempts:
                        break
            result["long_ttft_s"] = trio.current_time() - start
            result["attempts"] = attempts
            measuring[0] = False
            done.set()
    gaps.sort()
    result["stream_gaps"] = {
        "count": len(gaps),
        "p50_ms": 1000 * statistics.median(gaps) if gaps else None,
        "p99_ms": 1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None,
        "max_ms": 1000 * gaps[-1] if gaps else None,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model")
    parser.add_argument("--long-len", type=int, default=4000)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--retry-timeout", type=float, default=0.0)
    parser.add_argument("--max-attempts", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="")
    parser.add_argument("--json")
    args = parser.parse_args()
    result = trio.run(run, args)
    result["label"] = args.label
    print(json.dumps(result))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
