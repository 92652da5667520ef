"""What LoRA adapters cost a step on the default model: the median decode step of a batch, and the
step that prefills one prompt, with every row on the base model (LoRA off, then on but unused),
every row on one adapter, and the rows split over two adapters. Best of three rounds each.

    PYTHONPATH=. python benchmarks/bench_lora.py --batch-size 16 --prefill-len 512 --rank 8

The adapters are random, on all seven projections, written in PEFT's layout (no peft needed).
One torch thread, the default kernel threads, greedy, ignore_eos, 128-token prompts.
"""
import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from trillm import SamplingParams  # noqa: E402
from trillm.config import EngineArgs  # noqa: E402
from trillm.engine.core import EngineCore  # noqa: E402
from trillm.model.lora import TARGETS, module_shapes  # noqa: E402

PROMPT = "Once upon a time, in a small village nestled between two mountains, " * 48


def random_adapter(config, rank: int, seed: int) -> str:
    """A PEFT directory with random A and B on every target module of every layer."""
    torch.manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (out_features, in_features) in module_shapes(config).items():
            sub = TARGETS[module][0]
            name = f"base_model.model.model.layers.{layer}.{sub}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_features) / in_features**0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, rank) * 0.01
    path = tempfile.mkdtemp(prefix="bench-lora-")
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}, f)
    return path


def timed_steps(core: EngineCore, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> list[float]:
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        core.add_request(f"r{time.perf_counter_ns()}-{i}", prompt,
                         SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, lora_name=adapter))
    times = []
    while core.has_unfinished():
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    return times


def measure(core: EngineCore, batch: int, prefill_len: int, adapters: list[str | None], tag: int) -> tuple[float, float]:
    """(median decode step ms, prefill step ms), best of three. `tag` makes the prompts' first
    token differ from every other measurement's, so that no prefill hits the prefix cache."""
    base = core.tokenizer.encode(PROMPT)
    decode, prefill = [], []
    for r in range(3):
        first = 1000 + 10 * tag + r
        prompts = [[first] + base[:126] + [100 + i] for i in range(batch)]
        steps = timed_steps(core, prompts, [adapters[i % len(adapters)] for i in range(batch)], 24)
        decode.append(statistics.median(steps[-16:]) * 1e3)
        long = [first] + base[:prefill_len - 1]
        prefill.append(timed_steps(core, [long], adapters[:1], 1)[0] * 1e3)
    return min(decode), min(prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    plain = EngineCore(EngineArgs(num_kv_blocks=512))
    rows = [("LoRA off", plain, [None])]
    config = plain.config.hf_config
    paths = [random_adapter(config, args.rank, seed) for seed in (1, 2)]
    lora = EngineCore(EngineArgs(num_kv_blocks=512, enable_lora=True, max_loras=2, max_lora_rank=args.rank,
                                 lora_modules=f"a={paths[0]},b={paths[1]}"))
    rows += [("LoRA on, base rows", lora, [None]), ("one adapter", lora, ["a"]), ("two adapters", lora, ["a", "b"])]
    print(f"batch {args.batch_size}, prefill {args.prefill_len} tokens, rank {args.rank}, all seven projections")
    print("| rows | decode step (ms) | prefill step (ms) |")
    print("|---|---|---|")
    for tag, (name, core, adapters) in enumerate(rows):
        decode, prefill = measure(core, args.batch_size, args.prefill_len, adapters, tag)
        print(f"| {name} | {decode:.1f} | {prefill:.0f} |")


if __name__ == "__main__":
    main()
