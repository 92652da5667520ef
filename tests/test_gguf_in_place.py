"""GGUF files read in place: the families' tensor layouts against transformers, and a served file
that writes nothing to disk and holds no more memory than the file, its KV cache and a fixed
allowance."""
import json
import math
import os
import shutil
import subprocess
import sys

import openai
import pytest
import torch
import trio
from gguf import GGMLQuantizationType
from gguf_support import write_gguf
from process_support import start_server, thread_arenas
from transformers import AutoModelForCausalLM

from trillm.config import EngineArgs
from trillm.model.loader import default_model_path
from trillm.model.runner import ModelRunner

EXACT = dict(quantized_activations=False, kv_cache_dtype="float32", num_kv_blocks=16)
# What a served GGUF may hold besides its file (x 1.15) and the KV cache its requests wrote.
ALLOWANCE = 400 * 2**20


# Gemma 3's query scale as llama.cpp takes it: 1 / sqrt(head_dim), no key for it in the file
FAMILIES = {"llama": {}, "qwen2": {}, "qwen3": {}, "phi3": {}, "gemma3_text": {"query_pre_attn_scalar": 32}}


@pytest.mark.parametrize("kind", FAMILIES)
def test_each_familys_gguf_file_gives_transformers_logits(tiny_model_dir, tmp_path, kind):
    """A tiny random model of each family written as llama.cpp lays it out (q and k rows permuted
    for llama alone, Qwen2's q/k/v biases, Qwen3's q/k norms, Phi-3's fused q|k|v and gate|up and its
    window, Gemma 3's norms as 1 + w and its
    sliding and global layers): in F32, trillm's logits are transformers' on the model it came
    from. In Q8_0, the projections on the file's blocks and the embeddings read from it give, on
    fp32 activations, the logits of the file's dequantized weights; on 8-bit activations, within
    their error."""
    hf_dir = tiny_model_dir(kind, **FAMILIES[kind])
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    token_ids = list(range(3, 40))
    with torch.inference_mode():
        want = hf(torch.tensor([token_ids])).logits[0]
    f32 = write_gguf(hf_dir, str(tmp_path / "f32.gguf"))
    got = ModelRunner(EngineArgs(model=f32, quantized_weights=False, **EXACT)).teacher_forced_logits(token_ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    q8 = write_gguf(hf_dir, str(tmp_path / "q8.gguf"), GGMLQuantizationType.Q8_0)
    dense = ModelRunner(EngineArgs(model=q8, quantized_weights=False, **EXACT)).teacher_forced_logits(token_ids)
    runner = ModelRunner(EngineArgs(model=q8, **EXACT))
    assert runner.model.lm_head.quantized is not None and runner.model.model.embed_tokens.rows is not None
    torch.testing.assert_close(runner.teacher_forced_logits(token_ids), dense, atol=1e-4, rtol=1e-4)
    got = ModelRunner(EngineArgs(model=q8, **{**EXACT, "quantized_activations": True})).teacher_forced_logits(
        token_ids)
    error = ((got - dense).abs().mean() / dense.abs().mean()).item()
    assert error < 0.05 and (got.argmax(-1) == dense.argmax(-1)).float().mean() > 0.85, error


async def test_a_served_gguf_writes_nothing_and_stays_within_its_memory_bound(tmp_path):
    """`trillm serve` on the default model's file, with HOME, the temporary directory, the cache
    and the working directory empty: after answering requests, nothing was written anywhere there,
    and the server's peak resident memory (VmHWM: start-up included) stays within the file's size
    x 1.15 + the KV cache the requests wrote + ALLOWANCE. Its threads allocate from one malloc
    arena."""
    places = {name: tmp_path / name for name in ("home", "tmp", "cache", "cwd")}
    for place in places.values():
        place.mkdir()
    env = {**os.environ, "HOME": str(places["home"]), "TMPDIR": str(places["tmp"]),
           "TRILLM_CACHE": str(places["cache"]), "HF_HOME": str(places["home"] / "hf")}
    requests, max_tokens, block_size = 4, 64, 16
    async with trio.open_nursery() as nursery:
        command = [sys.executable, "-m", "trillm", "serve", "--port", "0", "--block-size", str(block_size)]
        process, url, _ = await start_server(nursery, command, env, cwd=places["cwd"])
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        prompt_tokens = []

        async def chat(i):
            answer = await client.chat.completions.create(
                model="SmolLM2-135M-Instruct", max_tokens=max_tokens, temperature=0,
                messages=[{"role": "user", "content": f"Tell me story number {i} about a dragon."}])
            prompt_tokens.append(answer.usage.prompt_tokens)

        async with trio.open_nursery() as chats:
            for i in range(requests):
                chats.start_soon(chat, i)
        with open(f"/proc/{process.pid}/status") as f:
            peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        arenas = thread_arenas(process.pid)
        process.terminate()
    # every thread allocated from glibc's main arena, which a trim empties whole (trillm.heap)
    assert arenas == 0, f"{arenas} thread arenas"
    # SmolLM2: 30 layers, K and V, 3 KV heads of 64 fp16 values a token
    block_bytes = 30 * 2 * block_size * 3 * 64 * 2
    kv_written = sum(math.ceil((n + max_tokens) / block_size) for n in prompt_tokens) * block_bytes
    bound = os.path.getsize(default_model_path()) * 1.15 + kv_written + ALLOWANCE
    assert peak <= bound, f"peak RSS {peak / 2**20:.0f} MiB over the bound {bound / 2**20:.0f} MiB"
    written = [str(p) for place in places.values() for p in place.rglob("*")]
    assert written == [], written


def test_a_model_found_unservable_while_loading_is_refused_in_one_line(tmp_path, tiny_model_dir):
    """What the header checks do not show is found while loading, in the engine's own process or
    in this one: here a GGUF vocabulary no tokenizer is built of, and a checkpoint directory one
    of whose tensors has another shape than its config makes it. The server ends as the checks
    would have refused it, exit 2 and one line on stderr, not a traceback."""
    from gguf_support import write_untokenizable_gguf
    from safetensors.torch import load_file, save_file

    untokenizable = write_untokenizable_gguf(str(tmp_path / "untokenizable.gguf"))
    misshapen = shutil.copytree(tiny_model_dir("llama"), tmp_path / "misshapen")
    weights = load_file(misshapen / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"] = weights["model.layers.1.mlp.down_proj.weight"][:8]
    save_file(weights, misshapen / "model.safetensors", metadata={"format": "pt"})
    cases = [([untokenizable, "--engine-process"], "The model file's tokenizer cannot be built (KeyError)."),
             ([untokenizable, "--no-engine-process"], "The model file's tokenizer cannot be built (KeyError)."),
             ([str(misshapen)], "'model.layers.1.mlp.down_proj.weight' has shape (8, 128), expected (64, 128).")]
    for argv, why in cases:
        run = subprocess.run([sys.executable, "-m", "trillm", "serve", *argv, "--port", "0"],
                             capture_output=True, text=True, timeout=120)
        said = run.stderr.splitlines()  # the log's lines, a progress bar's (cleared), then the refusal
        assert run.returncode == 2 and said[-1] == f"trillm serve: error: {why}", (argv, run.stderr)
        assert "Traceback" not in run.stderr and run.stderr.count("error") == 1, (argv, run.stderr)


SERVE_EACH = """
import contextlib, io, json, sys
from trillm.launch.cli import main
for argv in map(json.loads, sys.argv[1:]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = None
        except SystemExit as exc:
            code = exc.code
    print(json.dumps([argv, code, out.getvalue(), err.getvalue()]))
"""


def test_serve_refuses_a_model_it_cannot_serve_in_one_line_before_loading(tmp_path, tiny_model_dir):
    """`trillm serve` on a file of another architecture, a cut file, one short of its layers'
    tensors or holding one of another shape than its header makes it, or a missing path, named
    by --model or first without the flag (as `vllm serve MODEL`), or two models at once, over
    tensor-parallel ranks its heads or fused projections do not split over, for a longer context
    than its positions, or in a KV cache budget too small for a block, served alone or by
    data-parallel replicas (checked in a fork of their server, the supervisor light): exit 2,
    one line on stderr saying why, no traceback, and no rank started. One process runs the
    command line for each (each start would import torch again); anything but a SystemExit
    would end it with a traceback."""
    from gguf_support import write_foreign_gguf, write_gguf, write_misshapen_gguf

    layerless = write_foreign_gguf(str(tmp_path / "layerless.gguf"), "llama")
    misshapen = write_misshapen_gguf(str(tmp_path / "misshapen.gguf"))
    data = open(write_foreign_gguf(str(tmp_path / "bert.gguf")), "rb").read()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    bert, cut, missing = (str(tmp_path / name) for name in ("bert.gguf", "cut.gguf", "missing"))
    phi3 = write_gguf(tiny_model_dir("phi3"), str(tmp_path / "phi3.gguf"))
    cases = [(["serve", "--model", bert], "architecture is 'bert'"), (["serve", cut], "past the end"),
             (["serve", "--model", missing], "neither"), (["serve", missing, "--port", "0"], "neither"),
             (["serve", bert, "--model", cut], "the model is given twice"),
             (["serve", "--tensor-parallel-size", "2"], "9 attention heads do not split over 2"),
             (["serve", tiny_model_dir("llama"), "--tensor-parallel-size", "3"], "4 attention heads do not split"),
             (["serve", phi3, "--tensor-parallel-size", "2"], "fused projections"),
             (["serve", "--max-model-len", "100000"], "exceeds the model's max_position_embeddings 8192"),
             (["serve", tiny_model_dir("llama"), "--max-model-len", "100000"], "max_position_embeddings"),
             (["serve", "--kv-cache-memory", "1"], "holds no block of the KV cache"),
             (["serve", "--data-parallel-size", "2", "--max-model-len", "100000"], "max_position_embeddings 8192"),
             (["serve", "--data-parallel-size", "2", "--model", bert], "architecture is 'bert'"),
             (["serve", layerless], "lacks 19 of the tensors its 2 layers need, e.g. output_norm.weight"),
             (["serve", "--data-parallel-size", "2", layerless], "lacks 19 of the tensors"),
             (["serve", misshapen], "2 tensors of another shape than its header's model has for them, e.g. "
                                    "blk.0.ffn_down.weight (8, 32; the model's 32, 64)"),
             (["serve", "--data-parallel-size", "2", misshapen], "blk.0.ffn_down.weight (8, 32; the model's")]
    run = subprocess.run([sys.executable, "-c", SERVE_EACH, *(json.dumps(argv) for argv, _ in cases)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr[-2000:]
    outcomes = [json.loads(line) for line in run.stdout.splitlines()]
    assert [argv for argv, *_ in outcomes] == [argv for argv, _ in cases]
    for (argv, code, stdout, stderr), (_, why) in zip(outcomes, cases):
        assert code == 2 and stdout == "" and why in stderr and "Traceback" not in stderr, (argv, code, stderr)
        if why == "the model is given twice":  # a usage mistake: argparse's usage, then the one line
            stderr = stderr.splitlines()[-1] + "\n"
        assert len(stderr.splitlines()) == 1, stderr
