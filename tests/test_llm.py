"""The offline engine end to end on the default model. Greedy output is judged against transformers:
every token must be its argmax after the tokens before it (teacher forced, one forward pass per
sequence), which is what transformers' greedy generate would have produced, stop included."""
import json

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import trillm
from trillm import SamplingParams, StructuredOutput

MAX_TOKENS = 20
# The default model's GGUF blocks with fp32 activations: the numbers of the fp32 weights they
# dequantize to (transformers' model below), at the speed of reading the blocks.
ON_BLOCKS_EXACT = dict(quantized_activations=False)
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4, 5,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
    "synthesize foods from carbon dioxide and water. In plants it generally involves the green pigment "
    "chlorophyll and generates oxygen as a byproduct. Explain it to a child:",
    "Q: What is the boiling point of water at sea level in Celsius?\nA:",
    "List three primary colors:",
    "Once upon a time, in a small village nestled between two mountains, there lived an old clockmaker "
    "who had never once left the valley. Every morning he",
    "import torch\nx = torch.zeros(3)\nprint(",
]
SYSTEM = (
    "You are a careful assistant for a company that builds bicycles. You answer in one short sentence, "
    "you never invent part numbers, and you always mention safety when brakes are involved."
)
QUESTIONS = ["How do I fix a flat tire?", "What is a derailleur?", "Are disc brakes better?", "How often oil the chain?"]


@pytest.fixture(scope="module")
def hf_greedy(default_model_dir):
    """Asserts that a greedy completion is transformers' (fp32): each token its argmax given the
    prompt and the tokens before it, and the completion ends where greedy generate would end
    (at the end-of-sequence token, or after MAX_TOKENS)."""
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()

    def check(prompt_ids: list[int], completion, eos_token_id: int) -> None:
        tokens = completion.token_ids
        with torch.inference_mode():
            logits = model(torch.tensor([prompt_ids + tokens])).logits[0]
        assert logits[len(prompt_ids) - 1:-1].argmax(-1).tolist() == tokens
        if completion.finish_reason == "stop":
            assert tokens[-1] == eos_token_id and eos_token_id not in tokens[:-1]
        else:
            assert completion.finish_reason == "length" and len(tokens) == MAX_TOKENS and eos_token_id not in tokens

    return check


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def test_greedy_batch_matches_transformers_under_preemption_and_chunked_prefill(hf_greedy, tokenizer):
    # 16 blocks of 16 tokens cannot hold nine requests at once, so the scheduler must preempt;
    # a 24-token step budget splits every prompt longer than that over several steps.
    llm = trillm.LLM(num_kv_blocks=16, max_num_batched_tokens=24, enable_prefix_caching=False, **ON_BLOCKS_EXACT)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    assert sum(len(ids) > 24 for ids in prompt_ids) >= 2, "prompts must be long enough to be chunked"
    outputs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert llm.engine.stats().num_preemptions > 0, "the pool was meant to force preemption"
    for ids, out in zip(prompt_ids, outputs):
        (completion,) = out.outputs
        hf_greedy(ids, completion, llm.engine.config.eos_token_id)
    assert llm.engine.stats().num_used_blocks == 0


def test_structured_output_holds_under_preemption(tokenizer):
    # The pool of the test above: requests are preempted and recompute, their matchers carry on
    # (on the default model's GGUF blocks, as served: no transformers numbers to match here).
    llm = trillm.LLM(num_kv_blocks=16, max_num_batched_tokens=24, enable_prefix_caching=False)
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 10},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["word", "n"]}
    params = SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredOutput.from_schema(schema))
    outputs = llm.generate([tokenizer.encode(p) for p in PROMPTS], params)
    assert llm.engine.stats().num_preemptions > 0, "the pool was meant to force preemption"
    for out in outputs:
        (completion,) = out.outputs
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)
    assert llm.engine.stats().num_used_blocks == 0


def test_greedy_with_prefix_cache_hits_matches_transformers(hf_greedy):
    llm = trillm.LLM(num_kv_blocks=64, max_num_batched_tokens=64, **ON_BLOCKS_EXACT)
    conversations = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    llm.chat(conversations[0], greedy)  # warms the cache with the shared system prompt
    outputs = llm.chat(conversations, greedy)
    assert all(out.num_cached_tokens >= 32 for out in outputs), [o.num_cached_tokens for o in outputs]
    assert llm.engine.stats().prefix_cache_hits > 0
    for out in outputs:
        hf_greedy(out.prompt_token_ids, out.outputs[0], llm.engine.config.eos_token_id)


@pytest.fixture(scope="module")
def llm():
    """The default model as served (its GGUF blocks): what follows needs no transformers numbers."""
    return trillm.LLM(num_kv_blocks=128)


def test_abort_mid_generation_returns_every_block(llm, tokenizer):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"abort-{i}", tokenizer.encode(prompt), params)
    for _ in range(5):
        engine.step()
    assert engine.stats().num_used_blocks > 0
    for i in range(4):
        final = engine.abort_request(f"abort-{i}")
        assert final.finished and final.finish_reason == "abort"
    stats = engine.stats()
    assert stats.num_used_blocks == 0
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_kv_blocks
    assert not engine.has_unfinished()
    assert engine.abort_request("abort-0") is None


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    noise = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["Tell me a story:"], seeded)[0].outputs[0].token_ids
    again = llm.generate(["Tell me a story:"], seeded)[0].outputs[0].token_ids
    crowded = llm.generate(
        ["The weather today", "Tell me a story:", "Name a fruit:"], [noise, seeded, noise]
    )[1].outputs[0].token_ids
    other_seed = llm.generate(["Tell me a story:"], SamplingParams(**{**seeded.__dict__, "seed": 99}))
    assert alone == again == crowded
    assert other_seed[0].outputs[0].token_ids != alone


def test_stop_string_ends_the_request_and_frees_its_blocks(llm):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=["4,"])
    out = llm.generate(["1, 2, 3,"], params)[0].outputs[0]
    full = llm.generate(["1, 2, 3,"], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0]
    assert "4," in full.text
    assert out.finish_reason == "stop" and out.stop_reason == "4,"
    assert out.text == full.text[: full.text.index("4,")]
    assert llm.engine.stats().num_used_blocks == 0


def test_parallel_samples_and_chat(llm):
    out = llm.generate(["Pick a number:"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) >= 1 for c in out.outputs)
    chat = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=8))[0]
    assert chat.prompt.startswith("<|im_start|>") and chat.outputs[0].text


def test_samples_of_one_prompt_share_its_cached_blocks(llm):
    """As the server does: the first sample computes the prompt, the others are admitted after
    its first token and start after its full blocks; seeded samples still differ and repeat."""
    assert llm.engine.reset_prefix_cache()
    prompt = llm.tokenizer.encode("Name three rivers of Europe and say where each one rises. " * 4)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    full_blocks = (len(prompt) - 1) // llm.engine.args.block_size * llm.engine.args.block_size
    assert full_blocks > 0 and [c.num_cached_tokens for c in out.outputs] == [0, full_blocks, full_blocks]
    again = llm.generate([prompt], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
