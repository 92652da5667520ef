"""The OpenAI surface, judged by the real `openai` client against a live server on the default model:
streamed and whole answers agree, and usage, finish_reason and logprobs parse into the client's
types with the values they must have."""
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from http_support import metric_value, settled_stats

QUESTION = [{"role": "user", "content": "Name three colors."}]
PROMPT = "The capital of France is"
# Over three KV blocks of 16 tokens: enough for samples to share full prompt blocks.
LONG_PROMPT = (
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
    "synthesize foods from carbon dioxide and water. In plants it generally involves the green pigment "
    "chlorophyll and generates oxygen as a byproduct. Explain it to a child:"
)


async def collect(stream) -> list:
    return [chunk async for chunk in stream]


async def test_chat_stream_matches_whole_answer_and_usage(server):
    client = server.openai()
    whole = await client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=12, temperature=0)
    assert isinstance(whole, ChatCompletion) and whole.object == "chat.completion"
    (choice,) = whole.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    usage = whole.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.completion_tokens <= 12
    template = server.state.engine.core.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=True)
    assert usage.prompt_tokens == len(template["input_ids"])
    assert usage.prompt_tokens_details.cached_tokens >= 0

    chunks = await collect(await client.chat.completions.create(
        model=server.model, messages=QUESTION, max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True},
    ))
    *content_chunks, usage_chunk = chunks
    assert {c.id for c in chunks} == {chunks[0].id} and all(c.object == "chat.completion.chunk" for c in chunks)
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in content_chunks)
    assert [c.choices[0].finish_reason for c in content_chunks[:-1]] == [None] * (len(content_chunks) - 1)
    assert content_chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == choice.message.content
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens == usage.prompt_tokens
    assert usage_chunk.usage.completion_tokens == usage.completion_tokens
    # The same prompt again: its full blocks now come from the prefix cache.
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens > 0
    assert (await settled_stats(server.http()))["kv_cache_usage"] == 0


async def test_completions_stream_matches_whole_answer_for_text_and_token_prompts(server):
    client = server.openai()
    whole = await client.completions.create(model=server.model, prompt=PROMPT, max_tokens=10, temperature=0)
    assert isinstance(whole, Completion) and whole.object == "text_completion"
    (choice,) = whole.choices
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 10
    ids = server.state.engine.core.tokenizer.encode(PROMPT)
    assert whole.usage.prompt_tokens == len(ids)

    by_ids = await client.completions.create(model=server.model, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == choice.text

    chunks = await collect(await client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    ))
    *text_chunks, last = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    running = [c.usage.completion_tokens for c in text_chunks]
    assert running == sorted(running) and running[-1] == 10, "continuous usage grows to the total"
    assert last.choices == [] and last.usage.completion_tokens == 10


async def test_echo_and_a_list_of_prompts(server):
    prompts = [PROMPT, "One, two, three,"]
    out = await server.openai().completions.create(
        model=server.model, prompt=prompts, max_tokens=4, temperature=0, echo=True
    )
    assert [c.index for c in out.choices] == [0, 1]
    for prompt, choice in zip(prompts, out.choices):
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    tokenizer = server.state.engine.core.tokenizer
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == 8


async def test_chat_logprobs_have_openai_shape_streamed_and_whole(server):
    client = server.openai()
    args = dict(model=server.model, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    whole = await client.chat.completions.create(**args)
    assert whole.choices[0].finish_reason == "length"  # so every token is text too
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    for entry in content:
        assert isinstance(entry.token, str) and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        # Greedy: the chosen token is the most likely one.
        best = entry.top_logprobs[0]
        assert best.token == entry.token and best.logprob == pytest.approx(entry.logprob)
        # an alternative may hold part of a character: its text is then U+FFFD, its bytes its own
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs if "\ufffd" not in t.token)
    assert "".join(e.token for e in content) == whole.choices[0].message.content

    chunks = await collect(await client.chat.completions.create(**args, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, pytest.approx(e.logprob)) for e in content]


async def test_chat_logprob_bytes_rebuild_characters_split_between_tokens(server):
    """Byte-level BPE cuts CJK and emoji between tokens: such a token's text is U+FFFD, but its
    `bytes` are its own, so that a choice's bytes joined are its text, as OpenAI documents."""
    answer = "日本 😀"
    out = await server.openai().chat.completions.create(
        model=server.model, messages=QUESTION, max_tokens=20, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={"guided_choice": [answer]})
    content = out.choices[0].logprobs.content
    assert out.choices[0].message.content == answer
    assert any("\ufffd" in e.token and e.bytes != list(e.token.encode()) for e in content)  # a split character
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8")  # the stop token's too, as its text
    assert joined.startswith(answer) and joined[len(answer):] in ("", content[-1].token)


async def test_completion_logprobs_have_openai_shape(server):
    out = await server.openai().completions.create(
        model=server.model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and top[token] == pytest.approx(logprob)
        assert 2 <= len(top) <= 3 and max(top.values()) == pytest.approx(logprob)  # greedy: it is the best


async def test_n_samples_are_seeded_and_share_the_prompts_blocks(server):
    http = server.http()
    assert (await http.post("/flush_cache")).status_code == 200
    hits_before = await metric_value(http, "trillm:prefix_cache_hits_total")
    args = dict(model=server.model, prompt=LONG_PROMPT, max_tokens=8, n=3, seed=7, temperature=1.0)
    out = await server.openai().completions.create(**args)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1, "each sample has its own seed"
    prompt_tokens = len(server.state.engine.core.tokenizer.encode(LONG_PROMPT))
    assert prompt_tokens > 32
    assert out.usage.prompt_tokens == prompt_tokens, "the prompt counts once"
    assert out.usage.completion_tokens == 24
    # Samples 1 and 2 started after sample 0's prefill and found its full blocks cached.
    full_blocks_tokens = 16 * ((prompt_tokens - 1) // 16)
    hits = await metric_value(http, "trillm:prefix_cache_hits_total") - hits_before
    assert hits >= 2 * full_blocks_tokens
    again = await server.openai().completions.create(**args)
    assert [c.text for c in again.choices] == [c.text for c in out.choices], "same seed, same samples"


async def unstopped_greedy(server):
    """(client, request args, the greedy text of PROMPT with no stop, its words): stop tests
    pick their stop strings from words the model is known to say."""
    client = server.openai()
    args = dict(model=server.model, prompt=PROMPT, max_tokens=16, temperature=0)
    free = (await client.completions.create(**args)).choices[0].text
    words = free.split()
    assert len(words) >= 4, free
    return client, args, free, words


async def test_stop_string_ends_the_text_before_it(server):
    client, args, free, words = await unstopped_greedy(server)
    stop = words[2]
    stopped = await client.completions.create(**args, stop=[stop])
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert choice.text == free[: free.index(stop)]
    kept = await client.completions.create(**args, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == free[: free.index(stop) + len(stop)]
    streamed = await collect(await client.completions.create(**args, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert (await settled_stats(server.http()))["kv_cache_usage"] == 0


async def test_a_long_stop_list_ends_at_the_first_match(server):
    client, args, free, words = await unstopped_greedy(server)
    stops = [f"never-{i}" for i in range(20)] + [words[3], words[2]]  # OpenAI takes 4 at most; any number here
    choice = (await client.completions.create(**args, stop=stops)).choices[0]
    first = min(free.index(words[2]), free.index(words[3]))
    assert choice.finish_reason == "stop" and choice.text == free[:first]


async def test_vllm_extras_are_accepted(server):
    out = await server.openai().chat.completions.create(
        model=server.model, messages=QUESTION, max_completion_tokens=5, temperature=0.8, seed=3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 5,
                    "stop_token_ids": [2], "skip_special_tokens": True, "spaces_between_special_tokens": True,
                    "chat_template_kwargs": {}},
    )
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


async def test_cache_salt_isolates_tenants_in_the_prefix_cache(server):
    client = server.openai()

    async def cached(salt):
        extra = {} if salt is None else {"cache_salt": salt}
        # A prompt no other test sends, so no one cached its blocks before.
        out = await client.completions.create(model=server.model, prompt="Tenants apart. " + LONG_PROMPT, max_tokens=1,
                                              extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens

    await cached("tenant-a")  # computes and caches the prompt under tenant-a
    assert await cached("tenant-b") == 0 and await cached(None) == 0
    assert await cached("tenant-a") > 0 and await cached("tenant-b") > 0 and await cached(None) > 0
    bad = await server.http().post("/v1/completions", json={"prompt": "hi", "cache_salt": " "})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
