"""LoRA in the engine: the grouped multiply's three kernels, adapters read from PEFT directories
against transformers + peft (merged), steps mixing adapters, the registry's limits, and the prefix
cache kept apart per adapter."""
from __future__ import annotations


import pytest
import torch
from lora_support import make_adapter, reference

from http_support import EXACT
from trillm.config import EngineArgs
from trillm.engine.core import EngineCore
from trillm.engine.flag_check import parse_lora_modules
from trillm.model.lora import LoRAError
from trillm.kernels import lora, lora_cpu, lora_triton
from trillm.sampling_params import SamplingParamError, SamplingParams


@pytest.mark.cuda(cpu_too=True)  # the Triton kernel on the device there, in the interpreter here
@pytest.mark.parametrize("T,n_in,n_out,K,S,offsets", [(1, 64, 192, 12, 1, None), (9, 40, 33, 8, 3, None),
                                                      (33, 576, 960, 48, 2, [0, 576, 768, 960]),
                                                      (6, 64, 80, 8, 2, [0, 3, 80])])
def test_the_compiled_and_triton_kernels_equal_the_twin(T, n_in, n_out, K, S, offsets):
    """With `offsets`, b is block-diagonal over a fused projection's parts (as the slots hold it)."""
    torch.manual_seed(T)
    x, a, b = torch.randn(T, n_in), torch.randn(S, K, n_in), torch.randn(S, K, n_out)
    if offsets is not None:
        parts = len(offsets) - 1
        mask = torch.zeros(K, n_out)
        for p in range(parts):
            mask[p * K // parts:(p + 1) * K // parts, offsets[p]:offsets[p + 1]] = 1
        b *= mask
    slots = torch.randint(-1, S, (T,))
    slots[0] = 0  # at least one row with an adapter
    start = torch.randn(T, n_out)
    expected = start.clone()
    lora.lora_add(expected, x, a, b, slots)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for kernel, on in ((lora_cpu.lora_add, "cpu"), (lora_triton.lora_add, device)):
        y = start.to(on, copy=True)
        kernel(y, x.to(on), a.to(on), b.to(on), slots.to(on), offsets)
        torch.testing.assert_close(y.cpu(), expected, rtol=1e-4, atol=1e-3)
    base_rows = slots < 0
    assert torch.equal(expected[base_rows], start[base_rows])  # a row without an adapter is untouched
    assert not torch.equal(expected[~base_rows], start[~base_rows])


def engine(model_dir: str, **args) -> EngineCore:
    return EngineCore(EngineArgs(model=model_dir, num_kv_blocks=64, enable_lora=True, **{**EXACT, **args}))


def run(core: EngineCore, requests: dict[str, tuple[list[int], str | None]], max_tokens: int = 8):
    """Greedy outputs of requests added together (so they share steps): id -> (tokens, logprobs)."""
    for rid, (prompt, adapter) in requests.items():
        core.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0,
                                                     ignore_eos=True, lora_name=adapter))
    tokens = {rid: [] for rid in requests}
    logprobs = {rid: [] for rid in requests}
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprob for lp in out.new_logprobs or []]
    return {rid: (tokens[rid], logprobs[rid]) for rid in requests}


PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_and_logprobs_equal_transformers_with_the_merged_adapter(tiny_model_dir, kind):
    base = tiny_model_dir(kind)
    adapter = make_adapter(base, seed=1)
    core = engine(base, lora_modules=f"mine={adapter}")
    (tokens, logprobs), = run(core, {"r": (PROMPT, "mine")}).values()
    expected_tokens, expected_logprobs = reference(base, adapter, PROMPT, 8)
    assert tokens == expected_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < 1e-4
    assert tokens != reference(base, None, PROMPT, 8)[0]  # the adapter changes the answer


def test_the_default_model_on_its_gguf_blocks_takes_an_adapter(default_model_dir):
    """The GGUF file's quantized projections with an adapter on top give transformers + peft's
    greedy tokens (merged into the fp32 weights the blocks dequantize to)."""
    adapter = make_adapter(default_model_dir, seed=2, rank=8, alpha=16, modules=("q_proj", "v_proj", "down_proj"))
    core = EngineCore(EngineArgs(num_kv_blocks=32, enable_lora=True, lora_modules=f"a={adapter}", **EXACT))
    assert core.runner.model.model.layers[0].self_attn.qkv_proj.quantized is not None
    prompt = core.tokenizer.encode("The capital of France is")
    (tokens, logprobs), = run(core, {"r": (prompt, "a")}, max_tokens=6).values()
    expected_tokens, expected_logprobs = reference(default_model_dir, adapter, prompt, 6)
    assert tokens == expected_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < 1e-3
    assert tokens != reference(default_model_dir, None, prompt, 6)[0]


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_a_step_mixing_the_base_model_and_two_adapters_gives_each_row_its_own_output(tiny_model_dir, backend):
    base = tiny_model_dir("llama")
    a1, a2 = make_adapter(base, seed=1), make_adapter(base, seed=2)
    core = engine(base, max_loras=2, lora_modules=f"one={a1},two={a2}", attention_backend=backend)
    requests = {"base": (PROMPT, None), "one": (PROMPT, "one"), "two": (PROMPT[:5], "two"),
                "one-b": ([9, 4, 1, 9, 4, 1, 9, 4], "one")}
    num_tokens = 3 if backend == "triton" else 8  # the Triton interpreter is slow
    together = run(core, requests, num_tokens)
    if num_tokens == 8:  # outputs long enough to repeat: drafts (on by default) verified in adapter rows
        assert core.stats().spec_decode_num_drafts > 0
    for rid, request in requests.items():
        alone, = run(core, {rid + "-alone": request}, num_tokens).values()
        assert together[rid][0] == alone[0]
        assert max(abs(a - b) for a, b in zip(together[rid][1], alone[1])) < 1e-4
    assert len({tuple(together[rid][0]) for rid in ("base", "one")}) == 2


def test_an_adapter_gets_its_own_prefix_cache_blocks(tiny_model_dir):
    base = tiny_model_dir("llama")
    core = engine(base, lora_modules=f"one={make_adapter(base, seed=1)}")
    prompt = list(range(10, 60))  # three full blocks

    def cached(adapter):
        core.add_request("p", prompt, SamplingParams(max_tokens=1, lora_name=adapter))
        while core.has_unfinished():
            (out,) = core.step()
        return out.num_cached_tokens

    assert cached(None) == 0
    assert cached("one") == 0  # the base model's blocks hold other KV
    assert cached("one") == 48 and cached(None) == 48


def test_bad_adapters_are_refused_with_what_is_wrong(tiny_model_dir, tmp_path):
    base = tiny_model_dir("llama")
    core = engine(base, max_lora_rank=8)
    registry = core.loras
    cases = {
        "no adapter_config.json": str(tmp_path),
        "rank 16": make_adapter(base, seed=3, rank=16),
        "embed_tokens": make_adapter(base, seed=4, modules=("q_proj", "embed_tokens")),
        "does not fit this model at layer 0": make_adapter(tiny_model_dir("llama", hidden_size=32), seed=5),
        "use_dora": make_adapter(base, seed=6, use_dora=True),
    }
    for words, path in cases.items():
        with pytest.raises(LoRAError, match=words):
            registry.read(path)
    good = make_adapter(base, seed=1)
    core.load_lora("good", good, registry.read(good))
    with pytest.raises(LoRAError, match="already been loaded"):
        core.load_lora("good", good, registry.read(good))
    with pytest.raises(SamplingParamError, match="does not exist") as refused:
        core.add_request("x", PROMPT, SamplingParams(lora_name="other"))
    assert refused.value.param == "model" and refused.value.status == 404 and not core.has_unfinished()
    with pytest.raises(LoRAError) as unknown:
        core.unload_lora("other")
    assert unknown.value.status == 404


def test_unloading_an_adapter_in_use_is_refused_until_its_requests_end(tiny_model_dir):
    base = tiny_model_dir("llama")
    adapter = make_adapter(base, seed=1)
    core = engine(base, lora_modules=f"one={adapter}")
    core.add_request("r", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True, lora_name="one"))
    core.step()
    with pytest.raises(LoRAError, match="in use by 1 running requests") as busy:
        core.unload_lora("one")
    assert busy.value.status == 400
    while core.has_unfinished():
        core.step()
    assert core.unload_lora("one").name == "one"
    assert core.loras.nbytes == 0 and not core.loras.adapters


def test_max_cpu_loras_keeps_that_many_in_memory_and_reads_the_others_again(tiny_model_dir):
    base = tiny_model_dir("llama")
    paths = [make_adapter(base, seed=s) for s in (1, 2, 3)]
    core = engine(base, max_loras=1, max_cpu_loras=2,
                  lora_modules=",".join(f"a{i}={p}" for i, p in enumerate(paths)))
    assert core.loras.num_loaded == 2 and core.loras.adapters["a0"].weights is None  # the oldest dropped
    for i, path in enumerate(paths * 2):
        (tokens, _), = run(core, {f"r{i}": (PROMPT, f"a{i % 3}")}, max_tokens=4).values()
        assert tokens == reference(base, path, PROMPT, 4)[0]
        assert core.loras.num_loaded == 2


def test_lora_settings_that_cannot_run_are_refused(tiny_model_dir):
    base = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="needs --enable-lora"):
        EngineCore(EngineArgs(model=base, num_kv_blocks=8, lora_modules="a=/x"))
    with pytest.raises(ValueError, match="at least --max-loras"):
        engine(base, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_modules("just-a-path")
    assert parse_lora_modules("a=/p, b=/q") == [("a", "/p"), ("b", "/q")]
