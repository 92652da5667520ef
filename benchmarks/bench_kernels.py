"""Triton kernels against their torch baselines: time, speed-up and achieved memory bandwidth.

    python benchmarks/bench_kernels.py [--peak-gbps 3350] [--dtype bf16] [--json out.json]

(from the repository root, with trillm installed: `pip install -e .`, or PYTHONPATH=.)

On CUDA: Llama-3.2-1B-like shapes (32 query heads, 8 KV heads, head_dim 64, hidden 2048,
intermediate 8192), paged attention for decode (batch 1..256, context 512..8192), prefill
and a mixed step, plus the fused elementwise ops over 1..8192 tokens. Baselines: the torch
twins (what the CPU path runs: gather + SDPA for attention, eager ops otherwise) and, for
attention, SDPA on KV that is already contiguous (no paging: a lower bound torch cannot
reach with a paged cache). GB/s counts the bytes each op must move at least once; % peak is
against --peak-gbps (default: H100 SXM HBM3, 3.35 TB/s).

On CPU the kernels run in the Triton interpreter on tiny shapes: this checks that the
benchmark runs, and its figures mean nothing.
"""
import argparse
import json
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import torch.nn.functional as F  # noqa: E402

from trillm.kernels import activation, attention, cache, norm, rotary  # noqa: E402
from trillm.kernels import (  # noqa: E402
    activation_triton,
    attention_triton,
    cache_triton,
    norm_triton,
    rotary_triton,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def measure_ms(fn, on_cuda: bool) -> float:
    """Mean milliseconds per call. On CUDA: triton's do_bench (L2 flushed between calls, so
    memory-bound kernels are timed from HBM). On CPU: a few wall-clock calls."""
    if on_cuda:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50)
    fn()
    start = time.perf_counter()
    for _ in range(2):
        fn()
    return (time.perf_counter() - start) / 2 * 1e3


class Report:
    """Collects rows, prints them as they come, keeps them for --json."""

    def __init__(self, peak_gbps: float, on_cuda: bool):
        self.peak_gbps, self.on_cuda, self.rows = peak_gbps, on_cuda, []

    def add(self, op: str, shape: str, nbytes: int, fns: dict, flops: int = 0, note: str = ""):
        """fns: name -> callable; the first is the Triton kernel, the rest are baselines."""
        times = {name: measure_ms(fn, self.on_cuda) for name, fn in fns.items()}
        (name0, t0), *baselines = times.items()
        gbps = nbytes / (t0 * 1e-3) / 1e9
        row = dict(op=op, shape=shape, ms=times, gbps=gbps, pct_peak=100 * gbps / self.peak_gbps,
                   tflops=flops / (t0 * 1e-3) / 1e12, note=note)
        self.rows.append(row)
        vs = "  ".join(f"{name} {t:8.3f} ms (x{t / t0:5.2f})" for name, t in baselines)
        extra = f"  {row['tflops']:6.1f} TFLOP/s" if flops else ""
        print(f"{op:<20} {shape:<34} triton {t0:8.3f} ms  {gbps:7.0f} GB/s ({row['pct_peak']:3.0f}%)"
              f"{extra}  {vs}  {note}", flush=True)


# --- paged attention -----------------------------------------------------------------------


def paged_batch(num_queries, seq_lens, *, heads, kv_heads, head_dim, block_size, dtype, device):
    """Random q and a paged cache holding each request's context in shuffled blocks."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    ids = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        block_tables[b, :nb] = ids[used : used + nb]
        used += nb
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    q = torch.randn(sum(num_queries), heads, head_dim, dtype=dtype, device=device)
    starts = torch.tensor([0, *num_queries], device=device).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables, lens, starts


def dense_sdpa(num_queries, seq_lens, q, kv_heads, head_dim, dtype):
    """SDPA over contiguous KV, requests of equal shape batched: the no-paging reference."""
    assert len(set(num_queries)) == 1 and len(set(seq_lens)) == 1
    b, nq, n = len(seq_lens), num_queries[0], seq_lens[0]
    qd = q.view(b, nq, -1, head_dim).transpose(1, 2)
    k = torch.randn(b, kv_heads, n, head_dim, dtype=dtype, device=q.device)
    v = torch.randn_like(k)
    # is_causal aligns the mask top-left, which is right only when queries cover the context.
    causal = nq == n
    assert causal or nq == 1
    return lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=causal, enable_gqa=True)


def bench_attention(report, cfg, num_queries, seq_lens, label, dense_ok=True):
    q, k_cache, v_cache, block_tables, lens, starts = paged_batch(num_queries, seq_lens, **cfg)
    args = (q, k_cache, v_cache, block_tables, lens, starts, cfg["head_dim"] ** -0.5)
    fns = {"triton": lambda: attention_triton.paged_attention(*args)}
    if all(nq == 1 for nq in num_queries):  # where split-KV may kick in, show the single pass too
        fns["triton-1pass"] = lambda: attention_triton.paged_attention(*args, num_splits=1)
    # The twin gathers each request's KV, widens it to fp32 and (when SDPA falls back to its
    # math path) repeats it per query head; skip it where that would not fit.
    elem = q.element_size()
    twin_bytes = 2 * len(seq_lens) * max(seq_lens) * cfg["kv_heads"] * cfg["head_dim"] \
        * (elem + 4 + 4 * cfg["heads"] // cfg["kv_heads"])
    note = ""
    if cfg["device"] == "cpu" or twin_bytes < 0.7 * torch.cuda.mem_get_info()[0]:
        fns["torch-paged"] = lambda: attention.paged_attention(*args)
    else:
        note = f"(torch-paged skipped: needs ~{twin_bytes / 1e9:.0f} GB)"
    if dense_ok:
        fns["sdpa-dense"] = dense_sdpa(num_queries, seq_lens, q, cfg["kv_heads"], cfg["head_dim"], cfg["dtype"])
    kv_bytes = sum(seq_lens) * cfg["kv_heads"] * cfg["head_dim"] * 2 * elem
    nbytes = kv_bytes + 2 * q.numel() * elem
    # Each query attends to the keys up to its own position: 2 matmuls of 2 * D flops per key.
    visible = sum(sum(range(n - nq + 1, n + 1)) for nq, n in zip(num_queries, seq_lens))
    flops = 4 * visible * cfg["heads"] * cfg["head_dim"]
    report.add("paged_attention", label, nbytes, fns, flops=flops, note=note)


def attention_suite(report, cfg, on_cuda):
    if on_cuda:
        batches, contexts = (1, 8, 32, 64, 128, 256), (512, 2048, 8192)
        prefills = ((1, 512), (1, 2048), (1, 8192), (4, 2048))
        mixed = (64, 2048, 512, 1536)  # decodes at context, one chunk of new tokens after a cached prefix
    else:
        batches, contexts = (1, 2), (32, 64)
        prefills = ((1, 32),)
        mixed = (2, 32, 8, 16)
    for ctx in contexts:
        for b in batches:
            bench_attention(report, cfg, [1] * b, [ctx] * b, f"decode b={b} ctx={ctx}")
    for b, n in prefills:
        bench_attention(report, cfg, [n] * b, [n] * b, f"prefill b={b} len={n}")
    n_dec, ctx, chunk, cached = mixed
    bench_attention(report, cfg, [1] * n_dec + [chunk], [ctx] * n_dec + [cached + chunk],
                    f"mixed {n_dec}xdecode@{ctx} + {chunk}@{cached}", dense_ok=False)


# --- fused elementwise ops -----------------------------------------------------------------


def elementwise_suite(report, cfg, on_cuda):
    dtype, dev = cfg["dtype"], cfg["device"]
    hidden, inter, heads, kv_heads, head_dim = cfg["hidden"], cfg["inter"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    elem = torch.empty((), dtype=dtype).element_size()
    for t in (1, 64, 256, 2048, 8192) if on_cuda else (1, 4):
        x = torch.randn(t, hidden, dtype=dtype, device=dev)
        r = torch.randn_like(x)
        w = torch.randn(hidden, dtype=dtype, device=dev)
        report.add("rms_norm", f"T={t} hidden={hidden}", 2 * x.numel() * elem,
                   {"triton": lambda: norm_triton.rms_norm(x, w, 1e-5), "torch": lambda: norm.rms_norm(x, w, 1e-5)})
        report.add("fused_add_rms_norm", f"T={t} hidden={hidden}", 4 * x.numel() * elem,
                   {"triton": lambda: norm_triton.fused_add_rms_norm(x, r, w, 1e-5),
                    "torch": lambda: norm.fused_add_rms_norm(x, r, w, 1e-5)})

        gate_up = torch.randn(t, 2 * inter, dtype=dtype, device=dev)
        report.add("silu_and_mul", f"T={t} inter={inter}", 3 * t * inter * elem,
                   {"triton": lambda: activation_triton.silu_and_mul(gate_up),
                    "torch": lambda: activation.silu_and_mul(gate_up)})

        q = torch.randn(t, heads, head_dim, dtype=dtype, device=dev)
        k = torch.randn(t, kv_heads, head_dim, dtype=dtype, device=dev)
        positions = torch.randint(0, 8192, (t,), device=dev)
        inv_freq = 1.0 / 500000 ** (torch.arange(0, head_dim, 2, device=dev, dtype=torch.float32) / head_dim)
        angles = torch.arange(8192, device=dev, dtype=torch.float32)[:, None] * inv_freq
        cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
        # In place: repeated calls keep rotating the same buffers, which costs the same.
        report.add("rotary_embedding", f"T={t} q={heads}x{head_dim} k={kv_heads}",
                   2 * (q.numel() + k.numel()) * elem + t * head_dim * 4,
                   {"triton": lambda: rotary_triton.rotary_embedding(positions, q, k, cos_sin),
                    "torch": lambda: rotary.rotary_embedding(positions, q, k, cos_sin)})

        block_size = 16
        num_blocks = max(t // block_size * 2, 4)
        k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=dev)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(num_blocks * block_size, device=dev)[:t]
        report.add("write_kv", f"T={t} kv={kv_heads}x{head_dim}", 4 * k.numel() * elem,
                   {"triton": lambda: cache_triton.write_kv(k, k, k_cache, v_cache, slots),
                    "torch": lambda: cache.write_kv(k, k, k_cache, v_cache, slots)})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peak-gbps", type=float, default=3350.0,
                        help="the GPU's peak memory bandwidth in GB/s (default: H100 SXM, 3350)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--only", choices=("attention", "elementwise"), help="run one suite")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()

    on_cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    if on_cuda:
        device = "cuda"
        cfg = dict(heads=32, kv_heads=8, head_dim=64, hidden=2048, inter=8192, block_size=16)
        print(f"{torch.cuda.get_device_name()}; peak {args.peak_gbps:.0f} GB/s; dtype {args.dtype}")
    else:
        device = "cpu"
        torch.set_num_threads(1)
        cfg = dict(heads=4, kv_heads=2, head_dim=64, hidden=128, inter=128, block_size=16)
        print("CPU: no CUDA device, so the Triton kernels run in the interpreter on tiny shapes.\n"
              "These figures are NOT meaningful; this run only checks that the benchmark works.")
    cfg.update(dtype=DTYPES[args.dtype], device=device)
    print("Each baseline is shown as its time and (x N) = its time / the Triton time: N > 1 means "
          "the Triton kernel is faster.")
    report = Report(args.peak_gbps, on_cuda)
    attn_cfg = {k: cfg[k] for k in ("heads", "kv_heads", "head_dim", "block_size", "dtype", "device")}
    if args.only in (None, "attention"):
        attention_suite(report, attn_cfg, on_cuda)
    if args.only in (None, "elementwise"):
        elementwise_suite(report, cfg, on_cuda)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if on_cuda else "cpu (interpreter)",
                           meaningful=on_cuda, peak_gbps=args.peak_gbps, dtype=args.dtype,
                           rows=report.rows), f, indent=1)


if __name__ == "__main__":
    main()
