"""Each kind of integer projection of a loaded model, alone: its time on `--rows` rows of x and the
GOP/s that makes, beside this core's int8 roof (benchmarks/int8_roof.c), and on the AMX path,
for the rows it takes (more than 8), beside the tiles' roof (benchmarks/amx_roof.c). One op is a
multiply or an add, so a row against an N x K weight is 2 N K ops. What a step's profile cannot
say: whether the kernel is slower on one shape or format than another, and how far below its
roof it runs.

    PYTHONPATH=. python benchmarks/bench_projections.py --model FILE.gguf [--rows 8 64] [--threads 1] [--isa amx]

A kind is an output width, an input width and the bits of each part (a fused q|k|v may keep its
v in other bits); the first layer's projection of each kind stands for it. Best of five calls,
after one to warm up; a weight that fits in cache runs from there, as it does for a prompt's
later rows.
"""
import argparse
import time

import torch

from benchmarks.bench_quant_cpu import roof_gops
from benchmarks.bench_step import int8_projections, use_isa
from trillm.config import EngineArgs
from trillm.engine.core import EngineCore
from trillm.kernels.quant_cpu import Int8QuantizedLinear, isas

INT8_ROWS = 8  # the most rows the AVX-512 path takes on an AMX CPU (quant_int8_cpu.h's INT8_ROWS)


def projection_kinds(model: torch.nn.Module) -> dict[tuple, Int8QuantizedLinear]:
    kinds = {}
    for linear in int8_projections(model):
        kinds.setdefault((linear.out_features, linear.in_features, tuple(part.bits for part in linear.parts)), linear)
    return kinds


def best_seconds(linear: Int8QuantizedLinear, x: torch.Tensor, calls: int = 5) -> float:
    linear(x)
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        linear(x)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--threads", type=int, default=1, help="threads of the compiled kernels")
    parser.add_argument("--isa", choices=isas(), help="the integer kernel's path (default: the widest)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    core = EngineCore(EngineArgs(model=args.model, num_kv_blocks=16, kernel_threads=args.threads))
    path = args.isa or isas()[-1]
    roof, tiles_roof = roof_gops(), roof_gops("amx_roof.c") if path == "amx" else None
    print(f"int8 roof: {roof:.1f} GOP/s a core" if roof else "int8 roof: not measured",
          *([f"AMX tiles' roof: {tiles_roof:.1f} GOP/s a core"] if tiles_roof else []),
          f"{args.threads} kernel thread(s)", f"path {path}", sep="; ")
    if args.isa is not None:
        use_isa(core, args.isa)
    for (n, k, bits), linear in sorted(projection_kinds(core.runner.model).items()):
        for rows in args.rows:
            seconds = best_seconds(linear, torch.randn(rows, k))
            gops = 2 * rows * n * k / seconds / 1e9
            share = f" ({gops / (roof * args.threads):.0%} of the roof)" if roof else ""
            if tiles_roof and rows > INT8_ROWS:  # fewer take the AVX-512 path
                share += f" ({gops / (tiles_roof * args.threads):.0%} of the tiles' roof)"
            print(f"{n:6d} x {k:5d} bits {'+'.join(map(str, bits)):4s} rows {rows:4d}: {seconds * 1e3:8.2f} ms "
                  f"{gops:6.1f} GOP/s{share}", flush=True)


if __name__ == "__main__":
    main()
