"""How far the CPU defaults move a GGUF model from the file's own weights (fp32 copies of what
gguf-py dequantizes, fp32 activations and KV cache): the exact path on the kernels' blocks (fp32
activations; for a format the kernels do not read as it is, its 8-bit requantization), 8-bit
activations (trillm/kernels/quant_int8_cpu.h), an fp16 KV cache, and both (the default); then
an int8 KV cache (trillm/kernels/cache.py) on the exact path and with the default's 8-bit
activations, each also against the same path on the fp16 cache. Teacher-forced top-1 agreement
with the first and perplexity, on a fixed text, benchmarks/data/eval_text.txt.

    PYTHONPATH=. python benchmarks/bench_agreement.py [--model FILE.gguf] [--text FILE] [--json out.json]

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
from trillm.model.conversion import tokenizer_dir
from trillm.model.loader import resolve_model
from trillm.model.runner import ModelRunner

TEXT = os.path.join(os.path.dirname(__file__), "data", "eval_text.txt")


def teacher_forced(token_ids: list[int], args: EngineArgs) -> torch.Tensor:
    runner = ModelRunner(args)
    return runner.teacher_forced_logits(token_ids)


def measure(token_ids: list[int], paths: dict[str, dict], model: str | None = None,
            against: dict[str, str] | None = None) -> dict:
    """Per path (EngineArgs fields) its perplexity and, past the first, its agreement with the
    first; `against` names for some paths a second one to compare with (measured before them)."""
    common = dict(model=model, num_kv_blocks=512, max_num_batched_tokens=512)
    targets = torch.tensor(token_ids[1:])
    result = {"tokens": len(token_ids)}
    reference = None
    kept = {}
    for name, fields in paths.items():
        logits = teacher_forced(token_ids, EngineArgs(**common, **fields))
        nll = torch.nn.functional.cross_entropy(logits[:-1].double(), targets)
        row = {"perplexity": math.exp(nll.item())}
        if reference is None:
            reference = (logits, row["perplexity"])
        else:
            row["top1_agreement"] = (logits.argmax(-1) == reference[0].argmax(-1)).double().mean().item()
            row["max_abs_logit_diff"] = (logits - reference[0]).abs().max().item()
            row["perplexity_change"] = row["perplexity"] / reference[1] - 1
        if name in (against or {}):
            base_logits, base = kept[against[name]], result[against[name]]
            same = logits.argmax(-1) == base_logits.argmax(-1)
            row[f"top1_agreement_with {against[name]}"] = same.double().mean().item()
            row[f"perplexity_change_from {against[name]}"] = row["perplexity"] / base["perplexity"] - 1
        if name in (against or {}).values():
            kept[name] = logits
        result[name] = row
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--json")
    parser.add_argument("--model", help="a GGUF file (default: the default model's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    paths = {
        "the file's weights": dict(quantized_weights=False, quantized_activations=False, kv_cache_dtype="float32"),
        "exact": dict(quantized_activations=False, kv_cache_dtype="float32"),
        "int8 activations": dict(kv_cache_dtype="float32"),
        "fp16 KV cache": dict(quantized_activations=False),
        "default (both)": {},
        "int8 KV cache": dict(quantized_activations=False, kv_cache_dtype="int8"),
        "default, int8 KV cache": dict(kv_cache_dtype="int8"),
    }
    against = {"int8 KV cache": "fp16 KV cache", "default, int8 KV cache": "default (both)"}
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(args.model))
    with open(args.text) as f:
        token_ids = tokenizer.encode(f.read())
    result = measure(token_ids, paths, args.model, against)
    result["model"] = os.path.basename(args.model or resolve_model(None))
    print(f"tokens: {result['tokens']}")
    for name in paths:
        print(f"{name}: " + ", ".join(f"{k} {v:.6g}" for k, v in result[name].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
