"""The quantized linears on CPU in GOP/s, against the int8 roof of one core: SmolLM2-135M's
projections (q|k|v, o, gate|up, down: Q4_1; the tied vocab projection: Q8_0) at several row
counts, the exact kernel (fp32 activations) beside the integer one, on one thread and on two.

    PYTHONPATH=. python benchmarks/bench_quant_cpu.py [--rows 1 8 32 128 512] [--threads 1 2]

The weights are random blocks of the model's shapes, 30 layers of them, so that a pass streams
from memory as a decode step does (the layers' 60 MB and the vocab projection's 30 MB do not fit
in cache). One op is a multiply or an add: a row of x against an N x K weight is 2 N K ops. The
roof is benchmarks/int8_roof.c, independent vpdpbusd on registers (built here with gcc).
"""
import argparse
import os
import subprocess
import tempfile
import time

import torch

from trillm.kernels import pool_cpu, quant, quant_cpu

LAYERS = 30
LAYER = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]  # (N, K), Q4_1
VOCAB = (49152, 576)  # Q8_0


def random_weight(fmt: str, n: int, k: int, g: torch.Generator) -> quant.QuantizedWeight:
    scales = torch.rand(n, k // 32, generator=g) * 0.01
    if fmt == "q4_1":
        quants = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        return quant.QuantizedWeight(fmt, quants, scales, -8 * scales)
    return quant.QuantizedWeight(fmt, torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), scales, None)


def roof_gops(source: str = "int8_roof.c") -> float | None:
    """One core's GOP/s by the roof program `source` (benchmarks/), built here with gcc."""
    source = os.path.join(os.path.dirname(__file__), source)
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "roof")
        try:
            subprocess.run(["gcc", "-O2", "-o", binary, source], check=True, capture_output=True)
            return float(subprocess.run([binary], check=True, capture_output=True, text=True).stdout)
        except (OSError, subprocess.CalledProcessError, ValueError):
            return None  # no gcc, or not the instructions the program needs


def pass_seconds(linears, rows: int, repeats: int) -> float:
    """Best time of one pass over every linear, each on its own random x."""
    xs = [torch.randn(rows, linear.in_features) for linear in linears]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for linear, x in zip(linears, xs):
            linear(x)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    roof = roof_gops()
    print(f"int8 roof of one core (vpdpbusd on registers): {roof:.0f} GOP/s" if roof else "int8 roof: not measured")
    g = torch.Generator().manual_seed(0)
    weights = [random_weight("q4_1", n, k, g) for _ in range(LAYERS) for n, k in LAYER]
    weights.append(random_weight("q8_0", *VOCAB, g))
    ops_per_row = sum(2 * w.out_features * w.in_features for w in weights)
    kernels = {"fp32 activations": quant_cpu.QuantizedLinear, "int8 activations": quant_cpu.Int8QuantizedLinear}
    for name, cls in kernels.items():
        linears = [cls(w) for w in weights]
        for threads in args.threads:
            pool_cpu.set_threads(threads)
            for rows in args.rows:
                seconds = pass_seconds(linears, rows, args.repeats)
                gops = ops_per_row * rows / seconds / 1e9
                share = f", {100 * gops / (roof * threads):.0f}% of {threads} x roof" if roof and "int8" in name else ""
                print(f"{name}, {threads} thread(s), {rows:4d} rows: {seconds * 1e3:8.2f} ms a pass, "
                      f"{gops:6.1f} GOP/s{share}", flush=True)
    pool_cpu.set_threads(1)


if __name__ == "__main__":
    main()
