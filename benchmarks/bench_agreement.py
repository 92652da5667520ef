"""How far the integer path (8-bit activations, trillm/kernels/quant_int8_cpu.h) moves the
default model from the exact path (fp32 activations on the same GGUF blocks): teacher-forced top-1
agreement and perplexity on a fixed text, benchmarks/data/eval_text.txt.

    PYTHONPATH=. python benchmarks/bench_agreement.py [--text FILE] [--json out.json]

Top-1 agreement: the share of positions where both paths predict the same next token.
Perplexity: exp of the mean negative log-likelihood of the text's tokens, for each path.
"""
import argparse
import json
import math
import os

import torch
from transformers import AutoTokenizer

from trillm.config import EngineArgs
from trillm.engine.loader import resolve_model
from trillm.engine.runner import ModelRunner

TEXT = os.path.join(os.path.dirname(__file__), "data", "eval_text.txt")


def measure(token_ids: list[int], paths: dict[str, EngineArgs]) -> dict:
    """Per path its perplexity; with two paths, the agreement of the second with the first."""
    logits = {}
    for name, args in paths.items():
        runner = ModelRunner(args)
        logits[name] = runner.teacher_forced_logits(token_ids)
        del runner
    targets = torch.tensor(token_ids[1:])
    result = {"tokens": len(token_ids)}
    for name, lg in logits.items():
        nll = torch.nn.functional.cross_entropy(lg[:-1].double(), targets)
        result[f"perplexity_{name}"] = math.exp(nll.item())
    (first, a), (second, b) = logits.items()
    result["top1_agreement"] = (a.argmax(-1) == b.argmax(-1)).double().mean().item()
    result["max_abs_logit_diff"] = (a - b).abs().max().item()
    result["perplexity_change"] = result[f"perplexity_{second}"] / result[f"perplexity_{first}"] - 1
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    common = dict(num_kv_blocks=512, max_num_batched_tokens=512)
    paths = {"exact": EngineArgs(quantized_activations=False, **common), "int8": EngineArgs(**common)}
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    with open(args.text) as f:
        token_ids = tokenizer.encode(f.read())
    result = measure(token_ids, paths)
    for key, value in result.items():
        print(f"{key}: {value:.6g}" if isinstance(value, float) else f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
