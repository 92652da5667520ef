"""lm-evaluation-harness's `local-completions` runs a multiple-choice task against a live server.

Its loglikelihood requests are `echo: true, logprobs: 1, max_tokens: 1` completions whose
`token_logprobs[ctxlen:-1]` it sums per choice. The task (tests/data/lm_eval_tiny) is run as
token ids and as text, and each item's loglikelihoods and the accuracy lm-eval reports are
checked against transformers' on the same token ids. The server runs the exact path (fp32
activations and KV cache), on which trillm matches transformers to about 1e-4."""
import json
import os
import sys

import pytest
import torch
import trio
from transformers import AutoModelForCausalLM, AutoTokenizer

from http_support import exact_core, live_server

TASK_DIR = "tests/data/lm_eval_tiny"
TASK = "trillm_tiny_mc"


def transformers_loglikelihoods(model_dir: str) -> list[list[float]]:
    """Per item, per choice: log P(" " + choice | question) as lm-eval tokenizes them (context and
    continuation, with its target delimiter " ", encoded apart, then joined)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with open(os.path.join(TASK_DIR, f"{TASK}.jsonl")) as f:
        for line in f:
            doc = json.loads(line)
            context = tokenizer.encode(f"Question: {doc['question']}\nAnswer:")
            row = []
            for choice in doc["choices"]:
                continuation = tokenizer.encode(" " + choice)
                ids = context + continuation
                with torch.inference_mode():
                    logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
                row.append(sum(logprobs[len(context) + i - 1, t].item() for i, t in enumerate(continuation)))
            out.append((row, doc["answer"]))
    return out


def model_args(url: str, model: str, tokenizer: str, tokenized: bool) -> str:
    """lm-eval's `local-completions` arguments; `tokenizer`: a local directory, or "remote" for
    the server's /tokenizer_info and /tokenize."""
    backend = ["tokenizer_backend=remote"] if tokenizer == "remote" else [
        f"tokenizer={tokenizer}", "tokenizer_backend=huggingface"]
    return ",".join([f"model={model}", f"base_url={url}/v1/completions", *backend,
                     f"tokenized_requests={tokenized}", "num_concurrent=1", "max_retries=1"])


async def run_lm_eval(runs: list[str], out_dir: str) -> list[tuple[dict, list]]:
    """The task once per model arguments in `runs`: each run's (metrics, samples by item)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": "none"}
    out_path = os.path.join(out_dir, "evaluated.json")
    command = [sys.executable, os.path.join(os.path.dirname(__file__), "lm_eval_run.py"), TASK_DIR, TASK, out_path,
               *runs]
    result = await trio.run_process(command, env=env, capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 0, result.stderr.decode()[-4000:]
    with open(out_path) as f:
        evaluated = json.load(f)
    return [(run["results"], sorted(run["samples"], key=lambda s: s["doc_id"])) for run in evaluated]


@pytest.mark.slow
async def test_lm_eval_multiple_choice_matches_transformers_as_token_ids_and_as_text(default_model_dir, tmp_path):
    """Two runs: token ids, tokenized by lm-eval with the model's own tokenizer; and text,
    tokenized by the server (lm-eval's remote tokenizer)."""
    expected = transformers_loglikelihoods(default_model_dir)
    want = sum(max(range(len(row)), key=row.__getitem__) == answer for row, answer in expected) / len(expected)
    assert want > 0  # the model gets some right: a broken loglikelihood would not
    async with live_server(exact_core(default_model_dir)) as server:
        runs = [model_args(server.url, server.model, default_model_dir, tokenized=True),
                model_args(server.url, server.model, "remote", tokenized=False)]
        evaluated = await run_lm_eval(runs, str(tmp_path))
    assert len(evaluated) == 2
    for results, samples in evaluated:
        assert len(samples) == len(expected)
        for sample, (row, answer) in zip(samples, expected):
            got = [float(resp[0][0]) for resp in sample["resps"]]  # lm-eval logs them as strings
            assert got == pytest.approx(row, abs=1e-3), sample["doc"]
        assert results["acc,none"] == pytest.approx(want)
