"""Tool calling and reasoning against a live server on the default model, judged by the real `openai`
client. tool_choice required or named constrains the output to a call; auto reads calls out of the
model's text with the server's --tool-call-parser; --reasoning-parser splits <think> text off. For
the parsers, the model's text is steered with response_format (a regex), so a small model writes
exactly the shape a tool-calling or reasoning model would."""
import json

import jsonschema
import openai
import pytest
from http_support import live_server
from openai.types.chat import ChatCompletion, ChatCompletionMessageToolCall

from trillm.http.tool_parsers import default_parser

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


async def whole_and_streamed(client, **args) -> tuple[ChatCompletion, list]:
    whole = await client.chat.completions.create(**args)
    chunks = [c async for c in await client.chat.completions.create(**args, stream=True)]
    return whole, chunks


def streamed_calls(chunks) -> list[dict]:
    """The tool calls a client assembles from deltas: by index, id and name once, arguments appended."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] = (delta.function.name if delta.function else None) or call["name"]
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
    return [calls[i] for i in sorted(calls)]


def check_calls(whole: ChatCompletion, chunks, names: set[str]) -> list[dict]:
    """Whole and streamed calls agree, are of the client's types, name a tool and fit its schema."""
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and chunks[-1].choices[0].finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and all(isinstance(c, ChatCompletionMessageToolCall) and c.type == "function" for c in calls)
    assert all(c.id.startswith("call_") for c in calls)
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls(chunks)] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls
    ]
    return [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in calls]


async def test_named_and_required_tool_choice_force_a_valid_call(core):
    async with live_server(core) as server:
        client = server.openai()
        args = dict(model=server.model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=48)
        whole, chunks = await whole_and_streamed(
            client, **args, tool_choice={"type": "function", "function": {"name": "get_time"}}
        )
        assert len(check_calls(whole, chunks, {"get_time"})) == 1
        assert whole.choices[0].message.content is None
        call_chunks = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        assert len(call_chunks) > 1, "a named call's arguments stream as they come"
        assert call_chunks[0].choices[0].delta.tool_calls[0].id and not call_chunks[1].choices[0].delta.tool_calls[0].id
        whole, chunks = await whole_and_streamed(client, **args, tool_choice="required")
        assert len(check_calls(whole, chunks, {"get_weather", "get_time"})) == 1
        # The tools reach the prompt (SmolLM2's template has no tools: they go into the system message).
        plain = await client.chat.completions.create(model=server.model, messages=ASK, max_tokens=1)
        assert whole.usage.prompt_tokens > plain.usage.prompt_tokens + 50
        none = await client.chat.completions.create(model=server.model, messages=ASK, max_tokens=1, tools=TOOLS,
                                                    tool_choice="none")
        assert none.usage.prompt_tokens == plain.usage.prompt_tokens
        assert none.choices[0].message.tool_calls is None


HERMES_ANSWER = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
                 r'\{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}\n</tool_call>')
LLAMA3_ANSWER = r'\{"name": "get_time", "parameters": \{"zone": "(UTC|CET)"\}\}'


@pytest.mark.parametrize("parser, pattern, content, name", [
    ("hermes", HERMES_ANSWER, "Let me check.\n", "get_weather"),
    ("llama3_json", LLAMA3_ANSWER, None, "get_time"),
])
async def test_auto_tool_calls_are_parsed_from_the_text(core, parser, pattern, content, name):
    async with live_server(core, tool_call_parser=parser) as server:
        whole, chunks = await whole_and_streamed(
            server.openai(), model=server.model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=64,
            response_format={"type": "regex", "regex": pattern},
        )
        (call,) = check_calls(whole, chunks, {name})
        assert call["name"] == name
        assert whole.choices[0].message.content == content
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == (content or "")


TWO_CALLS = (r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\n</tool_call>\n'
             r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "CET"\}\}\n</tool_call>')


async def test_a_default_server_reads_auto_calls_and_parallel_false_keeps_one(core):
    """No --tool-call-parser: SmolLM2's template knows no tools, so trillm shows them in the Hermes
    format and reads the answer with the hermes parser. parallel_tool_calls false keeps the first
    of two calls, streamed and whole; left out, both come back."""
    async with live_server(core) as server:
        args = dict(model=server.model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=128,
                    response_format={"type": "regex", "regex": TWO_CALLS})
        whole, chunks = await whole_and_streamed(server.openai(), **args)
        assert [c["arguments"]["zone"] for c in check_calls(whole, chunks, {"get_time"})] == ["UTC", "CET"]
        whole, chunks = await whole_and_streamed(server.openai(), **args, parallel_tool_calls=False)
        assert [c["arguments"]["zone"] for c in check_calls(whole, chunks, {"get_time"})] == ["UTC"]


@pytest.mark.parametrize("template, parser", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),  # no tools: trillm shows them as Hermes
    ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}<tool_call>", "hermes"),  # Qwen, Hermes
    ("{% if tools %}{{ tools | tojson }}{% endif %}<|start_header_id|>assistant<|end_header_id|>", "llama3_json"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}", None),
])
def test_the_default_parser_follows_the_chat_template(template, parser):
    assert default_parser(template) == parser


async def test_tool_choice_errors_are_400s(core):
    async with live_server(core, tool_call_parser="none") as server:
        client = server.openai()
        cases = [
            (dict(tools=TOOLS, tool_choice="auto"), "tool_choice"),  # parsing turned off on this server
            (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
            (dict(tool_choice="required"), "tool_choice"),
            (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        ]
        for extra, param in cases:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model=server.model, messages=ASK, max_tokens=4, **extra)
            assert info.value.body["param"] == param, extra


THINKING = r"<think>\n?[a-z ]{1,24}\n?</think>\n\n[A-Z][a-z ]{1,16}\."


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
async def test_reasoning_is_split_off_streamed_and_whole(core, parser):
    async with live_server(core, reasoning_parser=parser) as server:
        whole, chunks = await whole_and_streamed(
            server.openai(), model=server.model, messages=ASK, temperature=0, max_tokens=64,
            response_format={"type": "regex", "regex": THINKING},
        )
        message = whole.choices[0].message
        reasoning = message.model_extra["reasoning_content"]
        assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
        assert message.content and "think>" not in message.content and message.content.endswith(".")
        streamed_reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                                     for c in chunks)
        assert streamed_reasoning == reasoning
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
