"""Anthropic's Messages API, judged by the real `anthropic` SDK (messages.create, messages.stream,
count_tokens, a tool round trip, its exception classes) and the Node SDK (`@anthropic-ai/sdk`,
create and stream) against a live server on the default model."""
import json

import jsonschema
import pytest
import trio

from http_support import failing_engine, live_server, node_modules, run_node, settled_stats

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
SYSTEM = "Answer briefly."
QUESTION = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"temperature": 0}  # sent as older clients send it: the SDK no longer has the argument


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


async def test_a_message_is_the_chat_answer_with_anthropic_usage(server):
    """Greedy text through /v1/messages equals /v1/chat/completions for the same conversation;
    usage counts the prompt once, cached tokens apart."""
    message = await server.anthropic().messages.create(
        model=server.model, max_tokens=12, system=SYSTEM, messages=QUESTION, extra_body=GREEDY,
        metadata={"user_id": "u-1"}, cache_control={"type": "ephemeral"}, service_tier="auto",
    )
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == server.model and message.content[0].type == "text"
    chat = await server.openai().chat.completions.create(
        model=server.model, max_tokens=12, extra_body=GREEDY,
        messages=[{"role": "system", "content": SYSTEM}, *QUESTION],
    )
    assert text_of(message) == chat.choices[0].message.content
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens and usage.cache_creation_input_tokens == 0


async def test_max_tokens_and_stop_sequences_set_the_stop_reason(server):
    client = server.anthropic()
    short = await client.messages.create(model=server.model, max_tokens=3, messages=QUESTION, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3 and short.stop_sequence is None
    whole = await client.messages.create(model=server.model, max_tokens=20, messages=QUESTION, extra_body=GREEDY)
    word = text_of(whole).split()[2]
    stopped = await client.messages.create(model=server.model, max_tokens=20, messages=QUESTION, extra_body=GREEDY,
                                           stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in text_of(stopped) and text_of(whole).startswith(text_of(stopped))


async def test_an_agents_max_tokens_beyond_the_context_is_a_cap():
    """Claude Code asks max_tokens 32000 of any model: on a model of a smaller context the message
    is served up to the context's end, its stop_reason max_tokens (a prompt that fills the
    context is still refused). message_start already counts the prompt, and the SDK reads the
    response's id from its request-id header."""
    from trillm.config import EngineArgs
    from trillm.engine.core import EngineCore

    story = [{"role": "user", "content": "Tell a long story about a clockmaker."}]
    core = EngineCore(EngineArgs(max_model_len=64, num_kv_blocks=16))
    try:
        async with live_server(core) as server:
            client = server.anthropic()
            message = await client.messages.create(model=server.model, max_tokens=32000, messages=story,
                                                   extra_body=GREEDY,
                                                   timeout=60)  # else the SDK asks to stream so long a cap
            assert message.stop_reason == "max_tokens"
            assert message.usage.input_tokens + message.usage.cache_read_input_tokens + message.usage.output_tokens == 64
            assert message._request_id == message.id
            body = {"model": server.model, "max_tokens": 32000, "messages": story, "stream": True}
            async with server.http().stream("POST", "/v1/messages", json=body) as response:
                assert response.headers["request-id"].startswith("msg_")
                start = json.loads([line async for line in response.aiter_lines() if line.startswith("data: ")][0][6:])
            assert start["type"] == "message_start"
            assert start["message"]["usage"]["input_tokens"] == message.usage.input_tokens + \
                message.usage.cache_read_input_tokens
            full = [{"role": "user", "content": "word " * 200}]
            refused = await server.http().post("/v1/messages", json={"model": server.model, "max_tokens": 32000,
                                                                     "messages": full})
            assert refused.status_code == 400 and refused.json()["type"] == "error"
    finally:
        core.close()


async def test_the_stream_is_anthropics_events_in_order_and_the_sdk_rebuilds_the_message(server):
    client = server.anthropic()
    async with client.messages.stream(model=server.model, max_tokens=12, system=SYSTEM, messages=QUESTION,
                                      extra_body=GREEDY) as stream:
        streamed = "".join([text async for text in stream.text_stream])
        final = await stream.get_final_message()
    whole = await client.messages.create(model=server.model, max_tokens=12, system=SYSTEM, messages=QUESTION,
                                         extra_body=GREEDY)
    assert streamed == text_of(final) == text_of(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    body = {"model": server.model, "max_tokens": 5, "messages": QUESTION, "stream": True, "temperature": 0}
    async with server.http().stream("POST", "/v1/messages", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in response.aiter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens" and datas[-2]["usage"]["output_tokens"] == 5


async def test_json_schema_output_config_is_enforced(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    message = await server.anthropic().messages.create(
        model=server.model, max_tokens=100, extra_body=GREEDY, messages=[{"role": "user", "content": "Invent a person."}],
        output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
    )
    jsonschema.validate(json.loads(text_of(message)), schema)


async def test_a_tool_round_trip(server):
    """A named tool forces a valid call; the call and its result go back as the next turns, and the
    model answers in text."""
    client = server.anthropic()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = await client.messages.create(model=server.model, max_tokens=40, extra_body=GREEDY, messages=ask,
                                          tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    (call,) = [b for b in called.content if b.type == "tool_use"]
    assert called.stop_reason == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    assert isinstance(call.input, dict) and isinstance(call.input["city"], str)
    history = ask + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in called.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C."},
                                     {"type": "text", "text": "Say it in one sentence."}]},
    ]
    answer = await client.messages.create(model=server.model, max_tokens=20, extra_body=GREEDY, messages=history,
                                          tools=[WEATHER], tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens") and text_of(answer)
    forced = await client.messages.create(model=server.model, max_tokens=40, extra_body=GREEDY, messages=ask,
                                          tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert [b.type for b in forced.content] == ["tool_use"] and forced.content[0].name == "get_weather"


async def test_count_tokens_is_the_prompt_a_message_uses(server):
    client = server.anthropic()
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    counted = await client.messages.count_tokens(model=server.model, system=system, messages=QUESTION)
    message = await client.messages.create(model=server.model, max_tokens=1, system=system, messages=QUESTION)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens > 0
    with_tools = await client.messages.count_tokens(model=server.model, system=system, messages=QUESTION,
                                                    tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens  # the template shows the tools


async def test_errors_are_the_sdks_own_exceptions(server, core):
    import anthropic  # here: every worker collects this module, one runs it, and the SDK is slow to import

    client = server.anthropic()
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="no-such-model", max_tokens=5, messages=QUESTION)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="text only"):
        await client.messages.create(model=server.model, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    with pytest.raises(anthropic.BadRequestError, match="max_tokens") as bad:
        await client.messages.create(model=server.model, max_tokens=0, messages=QUESTION)
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    as_text = await server.http().post("/v1/messages", json={"model": server.model, "max_tokens": "10",
                                                             "messages": QUESTION})
    assert as_text.status_code == 400 and "max_tokens" in as_text.json()["error"]["message"]  # a number as a string
    with pytest.raises(anthropic.BadRequestError, match="temperatur"):
        await client.messages.create(model=server.model, max_tokens=5, messages=QUESTION,
                                     extra_body={"temperatur": 0})
    async with live_server(core, max_body_bytes=4096) as small:
        with pytest.raises(anthropic.RequestTooLargeError):  # the SDK picks it by Anthropic's error type
            await small.anthropic().messages.create(model=small.model, max_tokens=2,
                                                    messages=[{"role": "user", "content": "x" * 6000}])
    async with live_server(core, api_key="sk-test") as keyed:
        with pytest.raises(anthropic.AuthenticationError):
            await keyed.anthropic(api_key="wrong").messages.create(model=keyed.model, max_tokens=2, messages=QUESTION)
        ok = await keyed.anthropic(api_key="sk-test").messages.create(model=keyed.model, max_tokens=2,
                                                                      messages=QUESTION)
        assert ok.usage.output_tokens == 2
        chat = await keyed.http().post("/v1/chat/completions", headers={"x-api-key": "sk-test"},
                                       json={"messages": QUESTION, "max_tokens": 1})
        assert chat.status_code == 200  # x-api-key guards every route as Bearer does
        refused = await keyed.http().post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1})
        assert refused.status_code == 401 and "error" in refused.json() and "type" not in refused.json()


async def test_an_agent_shaped_request_streams_to_its_end(server):
    """As a coding agent sends it: system blocks with cache_control, a dozen tools with JSON
    schemas, a history with tool calls and their results, streamed."""
    tools = [{"name": f"tool_{i}", "description": f"Tool number {i}.", "cache_control": {"type": "ephemeral"},
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"}},
                               "required": ["path"]}} for i in range(12)]
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Open main.py.", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Opening it."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "tool_3",
                                           "input": {"path": "main.py"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "print('hi')"}]}]},
        {"role": "assistant", "content": "It prints hi."},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": "permission denied"},
                                     {"type": "text", "text": "What next?"}]},
    ]
    system = [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
              {"type": "text", "text": "Be brief."}]
    async with server.anthropic().messages.stream(model=server.model, max_tokens=16, system=system, tools=tools,
                                                  tool_choice={"type": "auto"}, messages=history,
                                                  thinking={"type": "disabled"}) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use") and final.content
    stats = await settled_stats(server.http())
    assert stats["num_used_blocks"] == 0


async def test_a_client_that_leaves_or_an_abort_by_id_frees_every_block(server):
    client = server.anthropic()
    long = [{"role": "user", "content": "Tell a long story about a clockmaker."}]
    async with client.messages.stream(model=server.model, max_tokens=400, messages=long) as stream:
        async for event in stream:
            if event.type == "content_block_delta":
                break  # leave mid-stream
    http = server.http()
    assert (await settled_stats(http))["num_used_blocks"] == 0
    body = {"model": server.model, "max_tokens": 400, "messages": long, "stream": True, "temperature": 0}
    async with http.stream("POST", "/v1/messages", json=body) as response:
        lines = response.aiter_lines()
        start = None
        async for line in lines:
            if line.startswith("data: "):
                start = json.loads(line[6:])
                break
        assert start["type"] == "message_start"
        aborted = await http.post("/abort_request", json={"rid": start["message"]["id"]})
        assert aborted.status_code == 200
        with trio.fail_after(10):
            rest = [line async for line in lines if line]
    assert rest[-2:] == ["event: message_stop", 'data: {"type":"message_stop"}']
    # the turn the server stopped ends as Anthropic's paused one, which a client resends to go on
    (delta,) = [json.loads(line[6:]) for line in rest if line.startswith('data: {"type":"message_delta"')]
    assert delta["delta"]["stop_reason"] == "pause_turn"
    assert (await settled_stats(http))["num_used_blocks"] == 0


NODE_SDK = "@anthropic-ai/sdk@1.14.0"


@pytest.fixture(scope="session")
def node_sdk() -> str:
    """A node_modules folder holding the Anthropic Node SDK, installed once per machine."""
    return node_modules(NODE_SDK, "@anthropic-ai/sdk")


async def test_the_node_sdk_creates_and_streams(server, node_sdk):
    out = await run_node("anthropic_sdk.mjs", node_sdk, server.url, server.model)
    text = "".join(b["text"] for b in out["created"]["content"] if b["type"] == "text")
    assert out["created"]["id"].startswith("msg_") and text
    assert out["streamed"] == text == "".join(b["text"] for b in out["final"]["content"] if b["type"] == "text")
    assert out["final"]["stop_reason"] == out["created"]["stop_reason"]


async def test_an_assistant_prefill_is_continued(server):
    """A last assistant turn of text is Anthropic's prefill: the answer continues it, as chat's
    continue_final_message does, and holds only the new text."""
    prefill = [*QUESTION, {"role": "assistant", "content": "Red, green"}]
    message = await server.anthropic().messages.create(model=server.model, max_tokens=8, messages=prefill,
                                                       extra_body=GREEDY)
    chat = await server.openai().chat.completions.create(
        model=server.model, max_tokens=8, temperature=0, messages=prefill,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert text_of(message) == chat.choices[0].message.content and not text_of(message).startswith("Red, green")


async def test_reasoning_becomes_a_signed_thinking_block(core):
    """With a reasoning parser, the text before </think> opens a thinking block, closed with its
    signature_delta when the answer's text block opens (the builder fed as a stream feeds it)."""
    from trillm.engine.api import Delta, FinishReason
    from trillm.http.anthropic_messages import MessageBuilder
    from trillm.http.protocol.anthropic import MessagesRequest

    async with live_server(core, reasoning_parser="deepseek_r1") as server:
        req = MessagesRequest(model=server.model, max_tokens=8, messages=QUESTION)
        builder = MessageBuilder(server.state, req, "msg_x", req.chat(), "none", 0)
        events = []
        for text, finished in (("<think>\nsome ", False), ("thought\n</think>\n\nBlue.", True)):
            events += builder.feed(Delta(text=text, token_ids=[], logprobs=None, finished=finished,
                                         finish_reason=FinishReason.STOP if finished else None))
    kinds = [json.loads(e.split("data: ", 1)[1]) for e in events]
    thinking, text = builder.message()["content"]
    assert thinking["type"] == "thinking" and "some thought" in thinking["thinking"] and thinking["signature"]
    assert text == {"type": "text", "text": "Blue."}
    deltas = [k["delta"]["type"] for k in kinds if k["type"] == "content_block_delta"]
    assert deltas[:2] == ["thinking_delta", "thinking_delta"] and "signature_delta" in deltas
    assert deltas.index("signature_delta") < deltas.index("text_delta")


async def test_an_engine_that_dies_mid_stream_sends_an_error_event_then_529s(core):
    """The model failing mid-generation (the runner's fault hook): the stream ends with Anthropic's
    `error` event, which the SDK raises; new messages are 529 overloaded_error, its OverloadedError."""
    import anthropic  # here: every worker collects this module, one runs it, and the SDK is slow to import

    with failing_engine(core):
        async with live_server(core) as server:
            client = server.anthropic()
            with pytest.raises(anthropic.APIStatusError) as failed:
                async with client.messages.stream(model=server.model, max_tokens=100, messages=QUESTION,
                                                  extra_body={"temperature": 0, "top_k": 1}) as stream:
                    async for _ in stream:
                        pass
            assert "injected fault" in str(failed.value.body) and failed.value.body["type"] == "error"
            with pytest.raises(anthropic.OverloadedError) as refused:
                await client.messages.create(model=server.model, max_tokens=2, messages=QUESTION)
            assert refused.value.status_code == 529
            assert core.stats().num_used_blocks == 0 and not core.has_unfinished()
