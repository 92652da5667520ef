"""Prompt logprobs over HTTP, as evaluation harnesses ask for them: `echo` with `logprobs` on
/v1/completions (OpenAI's shape), vLLM's `prompt_logprobs` on completions and chat, SGLang's
`logprob_start_len` on /generate. The values themselves are checked against transformers in
tests/test_prompt_outputs.py; here, that every shape carries the same numbers."""
import json

import pytest

from http_support import settled_stats

PROMPT = "The capital of France is Paris, and the capital of Italy is"


async def test_echo_with_logprobs_returns_the_prompt_then_the_completion(server):
    client = server.openai()
    tokenizer = server.state.engine.core.tokenizer
    ids = tokenizer.encode(PROMPT)
    out = await client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2,
        extra_body={"ignore_eos": True},
    )
    (choice,) = out.choices
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(lp.tokens) == len(ids) + 3
    assert lp.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(top) >= 2 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs) if top)
    assert lp.text_offset[: 2] == [0, len(lp.tokens[0])] and lp.text_offset[len(ids)] == len(PROMPT)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 3

    # The prompt extended by the first generated token scores that token as the sampler did.
    first = choice.text[len(PROMPT):]
    scored = await client.completions.create(
        model=server.model, prompt=ids + [tokenizer.encode(first)[0]], max_tokens=0, echo=True, logprobs=0,
    )
    (alone,) = scored.choices
    assert alone.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert len(alone.logprobs.tokens) == len(ids) + 1
    assert alone.logprobs.token_logprobs[-1] == pytest.approx(lp.token_logprobs[len(ids)], abs=1e-3)
    assert alone.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:len(ids) + 1], abs=1e-3)
    stats = await settled_stats(server.http())
    assert stats["num_used_blocks"] == 0


async def test_echo_with_logprobs_streams_the_same_as_whole(server):
    client = server.openai()
    args = dict(model=server.model, prompt=[PROMPT, "One, two,"], max_tokens=4, temperature=0, echo=True,
                logprobs=1, extra_body={"ignore_eos": True})
    whole = await client.completions.create(**args)
    texts, logprobs = {}, {}
    async for chunk in await client.completions.create(**args, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                for key in ("tokens", "token_logprobs"):
                    logprobs.setdefault(c.index, {}).setdefault(key, []).extend(getattr(c.logprobs, key))
    for choice in whole.choices:
        assert texts[choice.index] == choice.text
        assert logprobs[choice.index]["tokens"] == choice.logprobs.tokens
        assert logprobs[choice.index]["token_logprobs"] == pytest.approx(choice.logprobs.token_logprobs)


async def test_max_tokens_zero_with_echo_is_the_prompt_alone(server):
    client = server.openai()
    out = await client.completions.create(model=server.model, prompt=PROMPT, max_tokens=0, echo=True)
    (choice,) = out.choices
    assert (choice.text, choice.finish_reason, choice.logprobs) == (PROMPT, "length", None)
    assert out.usage.completion_tokens == 0


async def test_vllm_prompt_logprobs_on_completions_and_chat(server):
    http = server.http()
    ids = server.state.engine.core.tokenizer.encode(PROMPT)
    body = {"model": server.model, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2,
            "echo": True, "logprobs": 0}
    out = (await http.post("/v1/completions", json=body)).json()
    (choice,) = out["choices"]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for position, entry in enumerate(entries[1:], start=1):
        own = entry[str(ids[position])]
        assert own["logprob"] == pytest.approx(choice["logprobs"]["token_logprobs"][position])
        ranks = sorted(v["rank"] for v in entry.values())
        # The top two, and the prompt token where it is not among them.
        assert ranks[:2] == [1, 2] and (len(entry) == 2 or ranks[2] == own["rank"] > 2)

    chat = (await http.post("/v1/chat/completions", json={
        "model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "prompt_logprobs": 0,
    })).json()
    prompt_ids = server.state.engine.core.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(prompt_ids)
    assert all(list(e) == [str(t)] for e, t in zip(chat["prompt_logprobs"][1:], prompt_ids[1:]))

    events = []
    async with http.stream("POST", "/v1/chat/completions", json={
        "model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "prompt_logprobs": 0, "stream": True,
    }) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    with_prompt = [e for e in events if "prompt_logprobs" in e]
    assert len(with_prompt) == 1 and with_prompt[0]["prompt_logprobs"] == chat["prompt_logprobs"]


async def test_generate_logprob_start_len(server):
    http = server.http()
    ids = server.state.engine.core.tokenizer.encode(PROMPT)
    out = (await http.post("/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
        "logprob_start_len": 4, "top_logprobs_num": 1,
    })).json()
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["finish_reason"]["type"] == "length"
    assert [t for _, t in meta["input_token_logprobs"]] == ids[4:]
    assert len(meta["input_top_logprobs"]) == len(ids) - 4 and all(len(top) == 1 for top in meta["input_top_logprobs"])
    whole = (await http.post("/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0,
    })).json()["meta_info"]["input_token_logprobs"]
    assert whole[0] == [None, ids[0]]
    assert [v for v, _ in whole[4:]] == pytest.approx([v for v, _ in meta["input_token_logprobs"]], abs=1e-5)
    plain = (await http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1},
                                                "return_logprob": True})).json()["meta_info"]
    assert "input_token_logprobs" not in plain
