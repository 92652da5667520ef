"""The peers' sampling and prompt extras on chat and completions, against a live server on the
default model, each judged by its effect: vLLM's allowed_token_ids, bad_words,
truncate_prompt_tokens and return_token_ids (TensorRT-LLM's and LMDeploy's too), TensorRT-LLM's
top_p_min, LMDeploy's min_new_tokens."""
import openai
import pytest
import trio

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = dict(temperature=0, max_tokens=16)


async def chat(server, **args):
    return await server.openai().chat.completions.create(model=server.model, **{"messages": ASK, **GREEDY, **args})


async def test_return_token_ids_whole_and_streamed(server):
    client = server.openai()
    tokens = (await server.http().post("/tokenize", json={"messages": ASK})).json()["tokens"]
    whole = await chat(server, extra_body={"return_token_ids": True})
    assert whole.model_extra["prompt_token_ids"] == tokens
    ids = whole.choices[0].model_extra["token_ids"]
    assert len(ids) == whole.usage.completion_tokens
    assert server.state.tokenizer.decode(ids, skip_special_tokens=True) == whole.choices[0].message.content
    chunks = [c async for c in await client.chat.completions.create(
        model=server.model, messages=ASK, stream=True, **GREEDY, extra_body={"return_token_ids": True})]
    assert chunks[0].model_extra["prompt_token_ids"] == tokens
    assert [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])] == ids
    plain = await chat(server)
    assert "prompt_token_ids" not in plain.model_extra and "token_ids" not in plain.choices[0].model_extra

    prompts = ["The capital of France is", "One, two,"]
    out = await client.completions.create(model=server.model, prompt=prompts, n=2, extra_body={"return_token_ids": True},
                                          **GREEDY)
    expected = [server.state.tokenizer.encode(p) for p in prompts]
    assert out.model_extra["prompt_token_ids"] == expected  # TensorRT-LLM's place
    for choice in out.choices:
        assert choice.model_extra["prompt_token_ids"] == expected[choice.index // 2]  # vLLM's
        assert server.state.tokenizer.decode(choice.model_extra["token_ids"]) == choice.text
    chunks = [c async for c in await client.completions.create(
        model=server.model, prompt=prompts[0], stream=True, extra_body={"return_token_ids": True}, **GREEDY)]
    firsts = [c.choices[0].model_extra["prompt_token_ids"] for c in chunks if c.choices]
    assert firsts[0] == expected[0] and not any(firsts[1:])
    streamed = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert server.state.tokenizer.decode(streamed) == "".join(c.choices[0].text for c in chunks if c.choices)


async def test_allowed_token_ids_bound_every_sampled_token(server):
    tokenizer = server.state.tokenizer
    allowed = sorted(set(tokenizer.encode(" yes no maybe Yes No")) | {tokenizer.eos_token_id})
    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        out = await chat(server, **sampling, extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
        ids = out.choices[0].model_extra["token_ids"]
        assert ids and set(ids) <= set(allowed), ids
    with pytest.raises(openai.BadRequestError) as info:
        await chat(server, extra_body={"allowed_token_ids": [10**7]})
    assert info.value.body["param"] == "allowed_token_ids"


async def test_bad_words_never_appear_in_the_output(server):
    tokenizer = server.state.tokenizer
    args = dict(model=server.model, prompt="The capital of France is", **GREEDY)
    plain = await server.openai().completions.create(**args)
    assert "Paris" in plain.choices[0].text
    banned = [tokenizer.encode(w, add_special_tokens=False) for w in ("Paris", " Paris")]
    out = await server.openai().completions.create(**args, extra_body={"bad_words": ["Paris"], "return_token_ids": True})
    ids = out.choices[0].model_extra["token_ids"]
    assert not any(ids[i:i + len(b)] == b for b in banned for i in range(len(ids)))
    assert out.choices[0].text != plain.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        await chat(server, extra_body={"bad_words": ["  "]})
    assert info.value.body["param"] == "bad_words"


async def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    client = server.openai()
    too_long = [server.state.tokenizer.encode(" apple")[0]] * (server.state.max_model_len + 8)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=server.model, prompt=too_long, max_tokens=1)
    out = await client.completions.create(model=server.model, prompt=too_long, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 12, "return_token_ids": True})
    assert out.usage.prompt_tokens == 12 and out.choices[0].model_extra["prompt_token_ids"] == too_long[-12:]
    full = await chat(server, max_tokens=1)
    cut = await chat(server, max_tokens=1, extra_body={"truncate_prompt_tokens": 5, "return_token_ids": True})
    assert cut.usage.prompt_tokens == 5
    whole_prompt = (await chat(server, max_tokens=1, extra_body={"return_token_ids": True})).model_extra["prompt_token_ids"]
    assert full.usage.prompt_tokens == len(whole_prompt) and cut.model_extra["prompt_token_ids"] == whole_prompt[-5:]
    echoed = await client.completions.create(model=server.model, prompt="one two three four five six", max_tokens=1,
                                             echo=True, extra_body={"truncate_prompt_tokens": 2})
    assert echoed.choices[0].text.startswith(" five six") and echoed.usage.prompt_tokens == 2


async def test_top_p_min_is_a_floor_under_top_p(server):
    """top_p near 0 samples the top token alone; with top_p_min 1 the request samples as top_p 1
    does, token for token under the same seed."""
    async def texts(**args) -> list[str]:
        outs = {}

        async def one(seed):
            outs[seed] = (await chat(server, temperature=1.0, max_tokens=12, seed=seed, **args)).choices[0].message.content

        async with trio.open_nursery() as nursery:
            for seed in range(4):
                nursery.start_soon(one, seed)
        return [outs[s] for s in range(4)]

    narrow = await texts(top_p=1e-9)
    floored = await texts(top_p=1e-9, extra_body={"top_p_min": 1.0})
    full = await texts(top_p=1.0)
    assert len(set(narrow)) == 1 and narrow[0] == (await chat(server, max_tokens=12)).choices[0].message.content
    assert floored == full and len(set(floored)) > 1


async def test_min_new_tokens_holds_off_the_end(server):
    short = await chat(server, max_tokens=64, messages=[{"role": "user", "content": "What is 2+2?"}])
    assert short.choices[0].finish_reason == "stop"
    at_least = short.usage.completion_tokens + 6
    longer = await chat(server, max_tokens=64, messages=[{"role": "user", "content": "What is 2+2?"}],
                        extra_body={"min_new_tokens": at_least})
    assert longer.usage.completion_tokens >= at_least


async def test_sglangs_no_stop_trim_keeps_the_stop_string(server):
    """sglang-router writes no_stop_trim and return_hidden_states into every request it forwards."""
    args = dict(model=server.model, prompt="The capital of France is", **GREEDY)
    free = (await server.openai().completions.create(**args)).choices[0].text
    stop = free.split()[1]
    trimmed = await server.openai().completions.create(**args, stop=[stop], extra_body={"no_stop_trim": False,
                                                                                        "return_hidden_states": False})
    kept = await server.openai().completions.create(**args, stop=[stop], extra_body={"no_stop_trim": True})
    assert trimmed.choices[0].text == free[: free.index(stop)]
    assert kept.choices[0].text == free[: free.index(stop) + len(stop)]
    with pytest.raises(openai.BadRequestError) as info:
        await server.openai().completions.create(**args, extra_body={"return_hidden_states": True})
    assert info.value.body["param"] == "return_hidden_states"
