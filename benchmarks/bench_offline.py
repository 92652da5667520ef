"""Offline throughput of a Llama-3.2-1B-shaped model with dummy weights: output tokens/s per batch
size, and the decode step time against the memory-bandwidth bound.

    python benchmarks/bench_offline.py                      # CUDA: batches 1 32 256, graphs
    python benchmarks/bench_offline.py --compare-eager      # CUDA: graphs and eager, side by side
    python benchmarks/bench_offline.py --device cpu --layers 4 --batch-sizes 1 4 --input-len 32 --output-len 8

(from the repository root, with trillm installed: `pip install -e .`, or PYTHONPATH=.)

Each batch is `batch` requests of `--input-len` random token ids, `--output-len` tokens each
(ignore_eos, greedy), submitted at once to one EngineCore and stepped to the end. Reported:
- output tok/s: batch * output_len / the whole run (prefill included), as offline serving sees it;
- decode step: mean time of the steps after every request has its first token (pure decode);
- bound: the least time a decode step can take, reading every weight once and each request's
  KV context once at peak memory bandwidth: (weight bytes + KV bytes) / --peak-gbps. The KV
  context is the mean over the decode steps (input_len + output_len / 2 tokens per request).
  "% of bound" = bound / measured: 100 % would be a step limited by memory bandwidth alone.

Peak bandwidth: --peak-gbps; by default 3350 GB/s (H100 SXM HBM3) on CUDA, and on CPU the rate of
a large torch copy on this machine's threads, measured at start.
"""
import argparse
import gc
import tempfile
import time

import torch
from transformers import LlamaConfig

from trillm.config import EngineArgs
from trillm.engine.core import EngineCore
from trillm.model.llama import head_dim_of
from trillm.sampling_params import SamplingParams

H100_SXM_GBPS = 3350.0


def llama_3_2_1b_config(num_layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=num_layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        bos_token_id=128000,
        eos_token_id=128001,
    )


def copy_gbps(num_threads: int, nbytes: int = 1 << 28) -> float:
    """GB/s of a large CPU tensor copy (bytes read + bytes written), best of five."""
    torch.set_num_threads(num_threads)
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_batch(core: EngineCore, batch: int, input_len: int, output_len: int, seed: int, device: str,
              prompts: list[list[int]] | None = None) -> dict:
    """Adds `batch` requests (random prompts of `input_len` tokens, or `prompts`) and steps the
    engine until they finish. Returns the total time, the time to every request's first token,
    and the decode steps' times."""
    generator = torch.Generator().manual_seed(seed)
    vocab = core.config.hf_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(0, vocab, (input_len,), generator=generator).tolist() if prompts is None else prompts[i]
        core.add_request(f"{seed}-{i}", prompt, params)
    started: set[str] = set()
    decode_times = []
    synchronize(device)
    begin = time.perf_counter()
    first_tokens_at = None
    while core.has_unfinished():
        all_started = len(started) == batch  # then no prompt is left: the step is pure decode
        step_begin = time.perf_counter()
        outputs = core.step()
        synchronize(device)
        now = time.perf_counter()
        if all_started:
            decode_times.append(now - step_begin)
        started.update(out.request_id for out in outputs)
        if first_tokens_at is None and len(started) == batch:
            first_tokens_at = now
    total = time.perf_counter() - begin
    return dict(total_s=total, prefill_s=first_tokens_at - begin, decode_times=decode_times)


def bench_mode(args, model_dir: str, enforce_eager: bool, peak_gbps: float) -> list[dict]:
    max_batch = max(args.batch_sizes)
    max_model_len = args.input_len + args.output_len
    block_size = 16
    engine_args = EngineArgs(
        model=model_dir,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        block_size=block_size,
        num_kv_blocks=max_batch * -(-max_model_len // block_size),
        max_model_len=max_model_len,
        max_num_seqs=max_batch,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,  # random prompts share nothing; keep the allocator out of it
        enforce_eager=enforce_eager,
        num_threads=args.threads,
    )
    start = time.perf_counter()
    core = EngineCore(engine_args)
    graphs = core.runner.decode_graphs
    mode = "eager" if graphs is None else f"cuda graphs ({len(graphs.sizes)} sizes)"
    print(f"\n{mode}: engine ready in {time.perf_counter() - start:.1f} s "
          f"({core.runner.config.dtype}, {core.config.hf_config.num_hidden_layers} layers)", flush=True)
    run_batch(core, min(2, max_batch), min(args.input_len, 16), 2, seed=0, device=args.device)  # warm-up

    model = core.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = core.config.hf_config
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim_of(cfg) \
        * core.runner.config.dtype.itemsize
    rows = []
    for batch in args.batch_sizes:
        result = run_batch(core, batch, args.input_len, args.output_len, seed=batch, device=args.device)
        assert core.stats().num_preemptions == 0, "the KV cache was sized to hold every request"
        step_s = sum(result["decode_times"]) / max(len(result["decode_times"]), 1)
        kv_bytes = batch * (args.input_len + args.output_len / 2) * kv_bytes_per_token
        bound_s = (weight_bytes + kv_bytes) / (peak_gbps * 1e9)
        row = dict(
            mode="eager" if graphs is None else "graphs",
            batch=batch,
            tok_s=batch * args.output_len / result["total_s"],
            total_s=result["total_s"],
            prefill_s=result["prefill_s"],
            step_ms=step_s * 1e3,
            bound_ms=bound_s * 1e3,
            pct_bound=100 * bound_s / step_s,
        )
        rows.append(row)
        print(f"  batch {batch:>4}: {row['tok_s']:9.1f} output tok/s; decode step {row['step_ms']:8.2f} ms, "
              f"bound {row['bound_ms']:7.2f} ms ({row['pct_bound']:.0f} %)", flush=True)
    del core, model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="auto: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (16 in Llama-3.2-1B)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")
    parser.add_argument("--compare-eager", action="store_true", help="CUDA: run with graphs, then eager")
    parser.add_argument("--peak-gbps", type=float,
                        help=f"peak memory bandwidth, GB/s (default: {H100_SXM_GBPS:.0f} on CUDA; measured on CPU)")
    parser.add_argument("--threads", type=int, default=1, help="CPU: torch threads")
    args = parser.parse_args()
    if args.device == "cpu" and (args.compare_eager or args.enforce_eager):
        parser.error("CUDA graphs exist only on CUDA: the CPU path is always eager")
    assert min(args.batch_sizes) >= 1 and max(args.batch_sizes) <= args.max_num_batched_tokens

    if args.device == "cuda":
        peak = args.peak_gbps or H100_SXM_GBPS
        print(f"{torch.cuda.get_device_name()}; peak {peak:.0f} GB/s")
    else:
        peak = args.peak_gbps or copy_gbps(args.threads)
        print(f"CPU, {args.threads} torch thread(s); peak {peak:.1f} GB/s"
              f"{'' if args.peak_gbps else ' (measured: a 256 MiB tensor copy)'}")
    print(f"Llama-3.2-1B shape, {args.layers} layers, dummy weights; input {args.input_len}, "
          f"output {args.output_len} tokens per request")

    eager_modes = [False, True] if args.compare_eager else [args.enforce_eager]
    rows = []
    with tempfile.TemporaryDirectory() as model_dir:
        llama_3_2_1b_config(args.layers).save_pretrained(model_dir)
        for enforce_eager in eager_modes:
            rows += bench_mode(args, model_dir, enforce_eager, peak)

    print("\n| mode | batch | output tok/s | total s | prefill s | decode step ms | bound ms | % of bound |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['batch']} | {r['tok_s']:.1f} | {r['total_s']:.2f} | {r['prefill_s']:.2f} "
              f"| {r['step_ms']:.2f} | {r['bound_ms']:.2f} | {r['pct_bound']:.0f} |")
    if args.compare_eager:
        by_key = {(r["mode"], r["batch"]): r for r in rows}
        for batch in args.batch_sizes:
            graphs, eager = by_key[("graphs", batch)], by_key[("eager", batch)]
            print(f"batch {batch}: eager decode step / graphs decode step = "
                  f"{eager['step_ms'] / graphs['step_ms']:.2f}")


if __name__ == "__main__":
    main()
