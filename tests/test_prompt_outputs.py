"""What the engine returns from a prompt's own rows: prompt logprobs and pooled hidden states,
judged against transformers on the exact path (fp32 activations and KV cache)."""
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForCausalLM

import trillm
from trillm import PoolingType, SamplingParams

EXACT = dict(quantized_activations=False, kv_cache_dtype="float32")


def hf_prompt_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row p is the log-distribution of token p + 1."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def hf_hidden(model_dir: str, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states [len(ids), hidden] (after the last norm)."""
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).last_hidden_state[0]


def check_prompt_logprobs(entries, ids, expected, start=0, num_top=0):
    assert len(entries) == len(ids) - start
    if start == 0:
        assert entries[0] is None
    for position in range(max(start, 1), len(ids)):
        entry = entries[position - start]
        row = expected[position - 1]
        assert entry.logprob == pytest.approx(row[ids[position]].item(), abs=1e-4)
        top_ids = [t for t, _ in entry.top]
        assert len(top_ids) == num_top
        assert [v for _, v in entry.top] == pytest.approx(row.topk(num_top).values.tolist(), abs=1e-4)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    shared = [rng.randrange(3, 256) for _ in range(20)]
    return [shared + [rng.randrange(3, 256) for _ in range(n)] for n in (9, 30, 1)]


def test_prompt_logprobs_match_transformers_over_chunks_and_despite_cached_blocks(tiny_model_dir, prompts):
    model_dir = tiny_model_dir("llama")
    llm = trillm.LLM(model_dir, num_kv_blocks=64, block_size=4, max_num_batched_tokens=12, **EXACT)
    llm.generate(prompts, SamplingParams(max_tokens=1))  # every prompt's full blocks are cached now
    hits_before = llm.engine.stats().prefix_cache_hits
    outs = llm.generate(prompts, [
        SamplingParams(max_tokens=0, prompt_logprobs=3),
        SamplingParams(max_tokens=2, prompt_logprobs=0, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=1, prompt_logprobs=5, prompt_logprobs_start=13),
    ])
    for out, start, num_top in zip(outs, (0, 0, 13), (3, 0, 5)):
        ids = out.prompt_token_ids
        check_prompt_logprobs(out.outputs[0].prompt_logprobs, ids, hf_prompt_logprobs(model_dir, ids), start, num_top)
        # Logits for every reported row are computed: only blocks wholly before start - 1 come from the cache.
        assert out.num_cached_tokens == max(start - 1, 0) // 4 * 4
    assert outs[0].outputs[0].token_ids == [] and outs[0].outputs[0].finish_reason == "length"
    assert len(outs[1].outputs[0].token_ids) == 2
    assert llm.engine.stats().prefix_cache_hits - hits_before == 12  # the third prompt's 3 blocks
    stats = llm.engine.stats()
    assert stats.num_used_blocks == 0 and stats.num_running == stats.num_waiting == 0


def test_prompt_logprobs_survive_preemption(tiny_model_dir, prompts):
    model_dir = tiny_model_dir("llama")
    alone = trillm.LLM(model_dir, num_kv_blocks=64, block_size=4, **EXACT)
    params = SamplingParams(max_tokens=6, prompt_logprobs=2, temperature=0, ignore_eos=True)
    expected = [alone.generate([p], params)[0].outputs[0] for p in prompts]
    tight = trillm.LLM(model_dir, num_kv_blocks=14, block_size=4, max_num_batched_tokens=8, **EXACT)
    outs = tight.generate(prompts, params)
    assert tight.engine.num_preemptions > 0
    for out, want in zip(outs, expected):
        got = out.outputs[0]
        assert got.token_ids == want.token_ids
        assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(want.prompt_logprobs)
        for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert [t for t, _ in g.top] == [t for t, _ in w.top]
            assert [g.logprob] + [v for _, v in g.top] == pytest.approx([w.logprob] + [v for _, v in w.top], abs=1e-5)


def test_prompt_logprobs_of_the_default_model_match_transformers(default_model_dir):
    llm = trillm.LLM(default_model_dir, num_kv_blocks=32, max_num_batched_tokens=16, **EXACT)
    text = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to hide."
    out = llm.generate(text, SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    ids = out.prompt_token_ids
    check_prompt_logprobs(out.outputs[0].prompt_logprobs, ids, hf_prompt_logprobs(default_model_dir, ids), 0, 1)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_embeddings_match_transformers_hidden_states_pooled(tiny_model_dir, prompts, kind):
    model_dir = tiny_model_dir(kind)
    llm = trillm.LLM(model_dir, num_kv_blocks=64, block_size=4, max_num_batched_tokens=8, **EXACT)
    llm.generate(prompts, SamplingParams(max_tokens=1))  # cached blocks, which only last pooling may use
    for pooling in PoolingType:
        vectors = llm.embed(prompts, pooling=pooling, normalize=False)
        normalized = llm.embed(prompts, pooling=pooling)
        for ids, got, unit in zip(prompts, vectors, normalized):
            hidden = hf_hidden(model_dir, ids)
            want = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(unit, F.normalize(want, dim=0), atol=1e-4, rtol=1e-4)
    assert llm.engine.stats().num_used_blocks == 0


def test_embeddings_of_the_default_model_match_transformers(default_model_dir):
    llm = trillm.LLM(default_model_dir, num_kv_blocks=32, max_num_batched_tokens=16, **EXACT)
    texts = ["A sentence about cats.", "Another, much longer sentence about the weather in the mountains."]
    for text, got in zip(texts, llm.embed(texts, pooling=PoolingType.MEAN, normalize=False)):
        ids = llm.tokenizer.encode(text)
        torch.testing.assert_close(got, hf_hidden(default_model_dir, ids).mean(0), atol=1e-4, rtol=1e-4)


def test_a_step_mixing_embeddings_and_generation_gives_each_its_result_alone(tiny_model_dir, prompts):
    model_dir = tiny_model_dir("llama")
    llm = trillm.LLM(model_dir, num_kv_blocks=64, block_size=4, max_num_batched_tokens=64, **EXACT)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    alone_tokens = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    alone_vectors = [llm.embed([p], pooling=PoolingType.MEAN)[0] for p in prompts]
    llm.engine.reset_prefix_cache()
    core = llm.engine
    for i, p in enumerate(prompts):
        core.add_request(f"g{i}", p, greedy)
        core.add_request(f"e{i}", p, trillm.PoolingParams(PoolingType.MEAN))
    tokens, pooled, mixed_steps = {}, {}, 0
    while core.has_unfinished():
        outs = core.step()
        kinds = {o.request_id[0] for o in outs}
        mixed_steps += kinds == {"g", "e"}
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.pooled is not None:
                pooled[o.request_id] = F.normalize(o.pooled, dim=0)
    assert mixed_steps > 0
    for i in range(len(prompts)):
        assert tokens[f"g{i}"] == alone_tokens[i]
        torch.testing.assert_close(pooled[f"e{i}"], alone_vectors[i], atol=1e-5, rtol=1e-5)


def test_a_prompt_logprobs_request_still_caches_its_own_blocks(tiny_model_dir, prompts):
    llm = trillm.LLM(tiny_model_dir("llama"), num_kv_blocks=64, block_size=4, **EXACT)
    first = llm.generate(prompts[1], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert first.num_cached_tokens == 0
    later = llm.generate(prompts[1], SamplingParams(max_tokens=1))[0]
    assert later.num_cached_tokens == (len(prompts[1]) - 1) // 4 * 4
