"""Every request field OpenAI documents for chat and completions, sent by the real `openai` SDK:
each is honoured where trillm can, or accepted without effect (README lists which), and the
ones that would change the answer in a way trillm cannot follow are refused by name."""
import inspect
import logging

import openai
import pytest

QUESTION = [{"role": "user", "content": "Name a color."}]
WEATHER_FN = {"name": "get_weather", "description": "The weather in a city.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


async def test_fields_without_effect_leave_the_answer_as_it_was(server):
    client = server.openai()
    base = dict(model=server.model, messages=QUESTION, max_completion_tokens=8, temperature=0, seed=1)
    plain = await client.chat.completions.create(**base)
    extras = await client.chat.completions.create(
        **base, store=True, service_tier="auto", prompt_cache_key="k1", prompt_cache_retention="in_memory",
        safety_identifier="user-hash", verbosity="low", modalities=["text"],
        prediction={"type": "content", "content": "Blue"}, web_search_options={}, audio={"voice": "alloy",
                                                                                           "format": "wav"},
        metadata={"team": "a"}, user="u1", frequency_penalty=0, presence_penalty=0, logit_bias={}, n=1,
        stream=False, top_p=1, stop=None, logprobs=False, parallel_tool_calls=None,
        extra_body={"prompt_cache_options": {}, "moderation": {}},
    )
    assert extras.choices[0].message.content == plain.choices[0].message.content


async def test_metadata_and_user_go_to_the_request_log(server, caplog):
    with caplog.at_level(logging.INFO, logger="trillm.http.openai_chat"):
        await server.openai().chat.completions.create(model=server.model, messages=QUESTION, max_tokens=2,
                                                      metadata={"team": "search"}, user="alice")
    assert any("user='alice'" in r.getMessage() and "'team': 'search'" in r.getMessage() for r in caplog.records)


async def test_reasoning_effort_reaches_the_chat_template(server):
    tokenizer = server.state.tokenizer
    original = tokenizer.chat_template
    # A template that shows what it was given, so the prompt's token count changes with it.
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if reasoning_effort is defined %} effort={{ reasoning_effort }}{% endif %}"
                               "{% if enable_thinking is defined and not enable_thinking %} no-think{% endif %}")
    try:
        client = server.openai()
        counts = {}
        for effort in (None, "high", "none"):
            extra = {} if effort is None else {"reasoning_effort": effort}
            out = await client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=1, **extra)
            counts[effort] = out.usage.prompt_tokens
        expected = {e: len(tokenizer.encode("Name a color." + s, add_special_tokens=False))
                    for e, s in ((None, ""), ("high", " effort=high"), ("none", " effort=none no-think"))}
        assert counts == expected
    finally:
        tokenizer.chat_template = original


async def test_legacy_functions_map_to_tools(server):
    client = server.openai()
    out = await client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Weather in Oslo?"}], max_tokens=40, temperature=0,
        functions=[WEATHER_FN], function_call={"name": "get_weather"},
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in call.function.arguments
    with pytest.raises(openai.BadRequestError) as both:
        await client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=1,
                                             functions=[WEATHER_FN], tools=[{"type": "function", "function": WEATHER_FN}])
    assert both.value.body["param"] == "functions"


@pytest.mark.parametrize("content, param", [
    ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "messages"),
    ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}], "messages"),
])
async def test_media_parts_on_a_text_model_are_a_clear_400(server, content, param):
    with pytest.raises(openai.BadRequestError) as refused:
        await server.openai().chat.completions.create(model=server.model, max_tokens=1,
                                                      messages=[{"role": "user", "content": content}])
    assert refused.value.body["param"] == param and "text only" in refused.value.body["message"]


async def test_audio_output_and_best_of_beyond_n_are_refused_by_name(server):
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as audio:
        await client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=1,
                                             modalities=["text", "audio"])
    assert audio.value.body["param"] == "modalities"
    with pytest.raises(openai.BadRequestError) as best_of:
        await client.completions.create(model=server.model, prompt="Hi", max_tokens=1, n=1, best_of=3)
    assert best_of.value.body["param"] == "best_of"


async def test_completions_take_every_documented_field(server):
    client = server.openai()
    out = await client.completions.create(
        model=server.model, prompt="The sky is", best_of=2, n=2, echo=False, frequency_penalty=0.1, logit_bias={},
        logprobs=1, max_tokens=4, presence_penalty=0.1, seed=3, stop=["\n\n"], stream=False, temperature=0.5,
        top_p=0.9, user="u2", suffix=None,
    )
    assert len(out.choices) == 2 and all(c.logprobs is not None for c in out.choices)
    alias = await client.completions.create(model=server.model, prompt="The sky is", max_tokens=16,
                                            extra_body={"max_completion_tokens": 3, "ignore_eos": True})
    assert alias.usage.completion_tokens == 3


SDK_ONLY = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
TOOL = {"type": "function", "function": WEATHER_FN}
# A value for every parameter the SDK's chat create takes (so, every field OpenAI documents),
# all in one request; the legacy functions / function_call go in a request of their own.
CHAT_VALUES = dict(
    messages=QUESTION, audio={"voice": "alloy", "format": "wav"}, frequency_penalty=0.1, logit_bias={"1": -1},
    logprobs=True, top_logprobs=2, max_completion_tokens=6, max_tokens=6, metadata={"k": "v"}, modalities=["text"],
    moderation={}, n=2, parallel_tool_calls=False, prediction={"type": "content", "content": "Blue"},
    presence_penalty=0.1, prompt_cache_key="key", prompt_cache_options={}, prompt_cache_retention="in_memory",
    reasoning_effort="low", response_format={"type": "text"}, safety_identifier="id", seed=7,
    service_tier="default", stop=["\n\n"], store=False, stream=True, stream_options={"include_usage": True},
    temperature=0.7, tool_choice="auto", tools=[TOOL], top_p=0.9, user="u", verbosity="medium",
    web_search_options={},
)
LEGACY = {"functions": [WEATHER_FN], "function_call": {"name": "get_weather"}}
COMPLETION_VALUES = dict(
    prompt="The sky is", best_of=2, echo=True, frequency_penalty=0.1, logit_bias={"1": -1}, logprobs=2,
    max_tokens=4, n=2, presence_penalty=0.1, seed=3, stop=["\n\n"], stream=True,
    stream_options={"include_usage": True}, suffix=None, temperature=0.5, top_p=0.9, user="u",
)


def sdk_parameters(create) -> set[str]:
    return set(inspect.signature(create).parameters) - SDK_ONLY - {"model"}


async def test_every_parameter_the_sdk_sends_is_taken(server):
    """The SDK's own parameter lists are the checklist: a parameter it gains fails here until a
    value for it is added above (and the README says whether it is honoured)."""
    client = server.openai()
    assert sdk_parameters(client.chat.completions.create) == set(CHAT_VALUES) | set(LEGACY)
    assert sdk_parameters(client.completions.create) == set(COMPLETION_VALUES)
    chunks = [c async for c in await client.chat.completions.create(model=server.model, **CHAT_VALUES)]
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1} and chunks[-1].usage.completion_tokens > 0
    legacy = await client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=40,
                                                  temperature=0, **LEGACY)
    assert legacy.choices[0].message.tool_calls[0].function.name == "get_weather"
    chunks = [c async for c in await client.completions.create(model=server.model, **COMPLETION_VALUES)]
    texts = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert set(texts) == {0, 1} and all(t.startswith("The sky is") for t in texts.values())
