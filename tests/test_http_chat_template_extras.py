"""The peers' chat-template extras, against a live server on the default model, each judged by the
prompt it makes (return_token_ids shows the exact ids) or the answer it shapes: vLLM's
chat_template, add_generation_prompt, continue_final_message, add_special_tokens and documents;
LMDeploy's string messages, do_preprocess and enable_thinking; SGLang's separate_reasoning and
stream_reasoning."""
import contextlib

import openai
import pytest
from http_support import live_server
from tokenizers import processors

ASK = [{"role": "user", "content": "What is the capital of France?"}]
ECHO_TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                 "{% for d in documents or [] %}<doc>{{ d.title }}: {{ d.text }}</doc>\n{% endfor %}"
                 "{% if enable_thinking is defined and not enable_thinking %}(no thinking)\n{% endif %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")


async def prompt_ids(server, **body) -> list[int]:
    """The prompt the server made for this chat body, by return_token_ids."""
    response = await server.http().post("/v1/chat/completions", json={
        "model": server.model, "max_tokens": 1, "temperature": 0, "return_token_ids": True, **body})
    assert response.status_code == 200, response.text
    return response.json()["prompt_token_ids"]


def rendered(tokenizer, messages, **kwargs) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, **kwargs), add_special_tokens=False)


async def test_a_request_template_needs_the_servers_trust(core):
    async with live_server(core) as server:
        with pytest.raises(openai.BadRequestError) as info:
            await server.openai().chat.completions.create(model=server.model, messages=ASK, max_tokens=1,
                                                          extra_body={"chat_template": ECHO_TEMPLATE})
        assert info.value.body["param"] == "chat_template"
    async with live_server(core, trust_request_chat_template=True) as server:
        tokenizer = server.state.tokenizer
        ids = await prompt_ids(server, messages=ASK, chat_template=ECHO_TEMPLATE)
        assert tokenizer.decode(ids) == "[user] What is the capital of France?\n[assistant]"
        docs = [{"title": "Atlas", "text": "Paris is the capital."}]
        ids = await prompt_ids(server, messages=ASK, chat_template=ECHO_TEMPLATE, documents=docs,
                               add_generation_prompt=False, enable_thinking=False)
        assert tokenizer.decode(ids) == ("[user] What is the capital of France?\n"
                                         "<doc>Atlas: Paris is the capital.</doc>\n(no thinking)\n")
        for template in ("{% for %}", "{% for i in range(10**9) %}{% endfor %}",  # the sandbox's range bound
                         "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",  # recursion without end
                         "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"):  # 10**10
            broken = await server.http().post("/v1/chat/completions", json={
                "model": server.model, "messages": ASK, "chat_template": template})
            assert broken.status_code == 400 and broken.json()["error"]["param"] == "chat_template", template
        assert "did not render within" in broken.json()["error"]["message"]  # the last: stopped at its deadline
        for template in ("{{ 'x' * 300000000 }}",  # one allocation past the bound
                         "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                         "{% endfor %}{{ ns.s | length }}"):  # doubling, line by line
            hungry = await server.http().post("/v1/chat/completions", json={
                "model": server.model, "messages": ASK, "chat_template": template})
            assert hungry.status_code == 400 and hungry.json()["error"]["param"] == "chat_template", template
            assert "needed more than 256 MiB" in hungry.json()["error"]["message"], hungry.text
        # and the template itself still serves: what the bounds stop is only the request's own run
        ids = await prompt_ids(server, messages=ASK, chat_template=ECHO_TEMPLATE)
        assert tokenizer.decode(ids) == "[user] What is the capital of France?\n[assistant]"
        # rendered out of the server as the server renders its own: the model's template brought along
        chat = [{"role": "system", "content": "Be brief."}, *ASK, {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Spain?"}]
        assert await prompt_ids(server, messages=chat, chat_template=tokenizer.chat_template) == \
            await prompt_ids(server, messages=chat)


async def test_generation_prompt_and_continued_final_message(server):
    tokenizer = server.state.tokenizer
    assert await prompt_ids(server, messages=ASK) == rendered(tokenizer, ASK, add_generation_prompt=True)
    assert await prompt_ids(server, messages=ASK, add_generation_prompt=False) == rendered(tokenizer, ASK)
    started = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
    ids = await prompt_ids(server, messages=started, add_generation_prompt=False, continue_final_message=True)
    assert ids == rendered(tokenizer, started, continue_final_message=True)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\nThe capital of France is")
    out = await server.openai().chat.completions.create(
        model=server.model, messages=started, max_tokens=4, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert out.choices[0].message.content.startswith(" Paris")
    for body in ({"messages": started, "continue_final_message": True},  # with the generation prompt
                 {"messages": ASK, "add_generation_prompt": False, "continue_final_message": True}):
        response = await server.http().post("/v1/chat/completions", json={"model": server.model, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == "continue_final_message"


@contextlib.contextmanager
def bos_on_encode(tokenizer):
    """The tokenizer adds its BOS when asked for special tokens (SmolLM2's adds none)."""
    backend = tokenizer.backend_tokenizer
    original = backend.post_processor
    bos = tokenizer.bos_token
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_token_id)])
    try:
        yield tokenizer.bos_token_id
    finally:
        backend.post_processor = original


async def test_add_special_tokens_adds_the_tokenizers_own(server):
    tokenizer = server.state.tokenizer
    with bos_on_encode(tokenizer) as bos:
        plain = await prompt_ids(server, messages=ASK)
        special = await prompt_ids(server, messages=ASK, add_special_tokens=True)
    assert special == [bos, *plain]


async def test_string_messages_and_do_preprocess(server):
    tokenizer = server.state.tokenizer
    text = "What is the capital of France?"
    assert await prompt_ids(server, messages=text) == await prompt_ids(server, messages=ASK)
    assert await prompt_ids(server, messages=text, do_preprocess=False) == tokenizer.encode(text)
    response = await server.http().post("/v1/chat/completions", json={
        "model": server.model, "messages": [{"role": "system", "content": "Be brief."}, *ASK], "do_preprocess": False})
    assert response.status_code == 400 and response.json()["error"]["param"] == "do_preprocess"


THINKING = r"<think>\n?[a-z ]{1,24}\n?</think>\n\n[A-Z][a-z ]{1,16}\."


async def test_separate_and_stream_reasoning(core, monkeypatch):
    # A token a step, so that a streamed reasoning arrives in several chunks: a step verifying
    # drafts may bring the whole of a short one at once (whether it drafts is measured, so timing).
    monkeypatch.setattr(core, "draft_policy", None)
    async with live_server(core, reasoning_parser="deepseek_r1") as server:
        client = server.openai()
        args = dict(model=server.model, messages=ASK, temperature=0, max_tokens=64,
                    response_format={"type": "regex", "regex": THINKING})
        split = await client.chat.completions.create(**args)
        reasoning = split.choices[0].message.model_extra["reasoning_content"]
        assert reasoning and "<think>" not in split.choices[0].message.content
        joined = await client.chat.completions.create(**args, extra_body={"separate_reasoning": False})
        assert joined.choices[0].message.content.startswith("<think>")
        assert "reasoning_content" not in joined.choices[0].message.model_extra
        chunks = [c async for c in await client.chat.completions.create(**args, stream=True)]
        pieces = [c.choices[0].delta.model_extra.get("reasoning_content") for c in chunks if c.choices]
        assert len([p for p in pieces if p]) > 1, "reasoning streams as it comes"
        held = [c async for c in await client.chat.completions.create(**args, stream=True,
                                                                     extra_body={"stream_reasoning": False})]
        pieces = [c.choices[0].delta.model_extra.get("reasoning_content") for c in held if c.choices]
        assert [p for p in pieces if p] == [reasoning]
        assert "".join(c.choices[0].delta.content or "" for c in held) == split.choices[0].message.content


async def test_include_reasoning_false_drops_the_reasoning(core):
    """vLLM's include_reasoning (vllm-router writes it into every chat request it forwards)."""
    async with live_server(core, reasoning_parser="deepseek_r1") as server:
        client = server.openai()
        args = dict(model=server.model, messages=ASK, temperature=0, max_tokens=64,
                    response_format={"type": "regex", "regex": THINKING})
        kept = await client.chat.completions.create(**args, extra_body={"include_reasoning": True})
        assert kept.choices[0].message.model_extra["reasoning_content"]
        dropped = await client.chat.completions.create(**args, extra_body={"include_reasoning": False})
        assert dropped.choices[0].message.model_extra["reasoning_content"] is None
        assert dropped.choices[0].message.content == kept.choices[0].message.content
        chunks = [c async for c in await client.chat.completions.create(**args, stream=True,
                                                                       extra_body={"include_reasoning": False})]
        assert not any(c.choices[0].delta.model_extra.get("reasoning_content") for c in chunks if c.choices)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == kept.choices[0].message.content
