"""The compiled CPU attention kernel alone (trillm/kernels/attention_cpu.pyx), on the default
model's shapes (9 query heads, 3 KV heads, head_dim 64, a cache in blocks of 16: fp16, or with
--cache int8, int8 rows and scales as trillm/kernels/cache.py lays them out):

- prefill: one request's chunk of `rows` query rows at the end of a `context`-token prompt, the
  best of three calls; GFLOP/s counts the score and value multiply-adds of every causal pair;
- decode: `batch` requests of one row each over `context` tokens, the median of 200 calls;
- step: a decode step's attention over every layer, each layer's cache of its own (so, as in the
  engine, each call reads its rows from memory, not from the last call's cache), at the shapes
  of STEP_SHAPES, its blocks scattered; the median of 10 steps, ms for all layers.

    PYTHONPATH=. python benchmarks/bench_attention_cpu.py --threads 1 2 --json benchmarks/results/attention_cpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from trillm.kernels import pool_cpu
from trillm.kernels.attention_cpu import paged_attention
from trillm.kernels.cache import to_cache

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CACHE_DTYPE = torch.float16  # --cache
PREFILL = [(4096, 512), (4096, 64), (1024, 1024)]  # (context, rows)
DECODE = [(1, 256), (1, 4096), (8, 256), (32, 256), (32, 1024)]  # (batch, context)
# name: (layers, heads, kv heads, head_dim, batch, context)
STEP_SHAPES = {"smollm2-135m": (30, 9, 3, 64, 32, 240), "smollm2-1.7b": (24, 32, 32, 64, 8, 220),
               "llama-3.2-3b": (28, 24, 8, 128, 8, 400)}


def cache(num_blocks: int, generator: torch.Generator, kv_heads: int = KV_HEADS,
          head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, BLOCK, kv_heads, head_dim)
    return (to_cache(torch.randn(shape, generator=generator), CACHE_DTYPE),
            to_cache(torch.randn(shape, generator=generator), CACHE_DTYPE))


def decode_rows(batch: int, context: int, generator: torch.Generator, heads: int = HEADS,
                head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's block tables (each request's `context` tokens in blocks scattered over a
    cache of batch * (context // BLOCK + 1) + 1), one query row a request, and the lengths."""
    per = context // BLOCK + 1
    tables = (torch.randperm(batch * per, generator=generator) + 1).int().view(batch, per).contiguous()
    q = torch.randn(batch, heads, head_dim, generator=generator)
    return tables, q, torch.full((batch,), context, dtype=torch.int32)


def prefill(context: int, rows: int, generator: torch.Generator) -> dict:
    blocks = context // BLOCK + 1
    k, v = cache(blocks + 1, generator)
    tables = torch.randperm(blocks + 1, generator=generator)[:blocks].int()[None].contiguous()
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=generator)
    lens, starts = torch.tensor([context], dtype=torch.int32), torch.tensor([0, rows], dtype=torch.int32)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        paged_attention(q, k, v, tables, lens, starts, HEAD_DIM**-0.5)
        best = min(best, time.perf_counter() - start)
    pairs = rows * context - rows * (rows - 1) // 2
    return {"context": context, "rows": rows, "ms": best * 1e3, "ns_per_pair": best / pairs * 1e9,
            "gflops": pairs * HEADS * HEAD_DIM * 4 / best / 1e9}


def decode(batch: int, context: int, generator: torch.Generator) -> dict:
    k, v = cache(batch * (context // BLOCK + 1) + 1, generator)
    tables, q, lens = decode_rows(batch, context, generator)
    for _ in range(10):
        paged_attention(q, k, v, tables, lens, None, HEAD_DIM**-0.5)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        paged_attention(q, k, v, tables, lens, None, HEAD_DIM**-0.5)
        times.append(time.perf_counter() - start)
    return {"batch": batch, "context": context, "us": statistics.median(times) * 1e6}


def step(name: str, generator: torch.Generator) -> dict:
    layers, heads, kv_heads, head_dim, batch, context = STEP_SHAPES[name]
    caches = [cache(batch * (context // BLOCK + 1) + 1, generator, kv_heads, head_dim) for _ in range(layers)]
    tables, q, lens = decode_rows(batch, context, generator, heads, head_dim)
    times = []
    for _ in range(12):
        start = time.perf_counter()
        for k, v in caches:
            paged_attention(q, k, v, tables, lens, None, head_dim**-0.5)
        times.append(time.perf_counter() - start)
    return {"shape": name, "layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "batch": batch, "context": context, "ms": statistics.median(times[2:]) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="the kernels' pool threads")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--cache", choices=("float16", "int8"), default="float16", help="the cache's dtype")
    parser.add_argument("--only", choices=("prefill", "decode", "step"), help="run one kind")
    args = parser.parse_args()
    global CACHE_DTYPE
    CACHE_DTYPE = getattr(torch, args.cache)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    results = []
    for threads in args.threads:
        previous = pool_cpu.set_threads(threads)
        try:
            for context, rows in PREFILL if args.only in (None, "prefill") else []:
                r = {"threads": threads, "kind": "prefill", **prefill(context, rows, generator)}
                print(f"threads {threads}  prefill: {rows:5d} rows at context {context:5d}  {r['ms']:8.1f} ms  "
                      f"{r['ns_per_pair']:6.1f} ns/pair  {r['gflops']:5.1f} GFLOP/s", flush=True)
                results.append(r)
            for batch, context in DECODE if args.only in (None, "decode") else []:
                r = {"threads": threads, "kind": "decode", **decode(batch, context, generator)}
                print(f"threads {threads}  decode: batch {batch:3d} at context {context:5d}  {r['us']:8.1f} us",
                      flush=True)
                results.append(r)
            for name in STEP_SHAPES if args.only in (None, "step") else []:
                r = {"threads": threads, "kind": "step", **step(name, generator)}
                print(f"threads {threads}  step: {name} batch {r['batch']} at context {r['context']}  "
                      f"{r['ms']:8.2f} ms", flush=True)
                results.append(r)
        finally:
            pool_cpu.set_threads(previous)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK,
                                  "cache": args.cache}, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
