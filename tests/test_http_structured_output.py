"""response_format against a live server on the default model, judged by the real `openai` client:
JSON schemas, JSON objects, regular expressions and EBNF grammars hold in the output, streamed or
not; a bad spec is a 400 naming it; and constraining some requests of a batch leaves the others'
greedy outputs as they are alone."""
import json
import re

import jsonschema
import openai
import pytest
import trio
from http_support import settled_stats

ASK = "Answer with JSON describing something from your favourite story."

NAME = {"type": "string", "maxLength": 16}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
     "required": ["title", "year"]},
    {"type": "object", "properties": {"kind": {"const": "book"}, "pages": {"type": "integer", "minimum": 1,
                                                                          "maximum": 999}}, "required": ["kind", "pages"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "maximum": 999}, {"type": "null"}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
     "required": ["answer", "sure"]},
    {"type": "object", "properties": {"city": NAME, "country": NAME}, "required": ["city", "country"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "minItems": 1, "items": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "active": {
        "type": "boolean"}, "role": {"enum": ["admin", "user"]}}, "required": ["id", "active", "role"]},
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    {"type": "object", "properties": {"hero": {"type": "object", "properties": {"name": NAME, "power": {
        "enum": ["fire", "ice"]}}, "required": ["name", "power"]}}, "required": ["hero"]},
    {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1,
                                                "maxItems": 3}}, "required": ["flags"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 50},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["temperature", "unit"]},
]
MAX_TOKENS = 96  # every schema above ends well within this


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


async def chat_text(client, model: str, stream: bool, max_tokens: int = MAX_TOKENS, **args) -> tuple[str, str]:
    """(content, finish_reason) of one greedy chat answer, streamed or whole."""
    messages = [{"role": "user", "content": ASK}]
    base = dict(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
    if not stream:
        out = await client.chat.completions.create(**base, **args)
        return out.choices[0].message.content, out.choices[0].finish_reason
    chunks = [c async for c in await client.chat.completions.create(**base, **args, stream=True)]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


async def test_json_schema_output_validates_streamed_and_whole(server):
    client = server.openai()
    results = {}

    async def one(i: int, stream: bool) -> None:
        results[i, stream] = await chat_text(
            client, server.model, stream, response_format=json_schema_format(SCHEMAS[i])
        )

    async with trio.open_nursery() as nursery:
        for i in range(len(SCHEMAS)):
            for stream in (False, True):
                nursery.start_soon(one, i, stream)
    assert len(results) == 2 * len(SCHEMAS) == 40
    for (i, stream), (text, finish_reason) in sorted(results.items()):
        assert finish_reason == "stop", (i, stream, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i])
    assert (await settled_stats(server.http()))["kv_cache_usage"] == 0


async def test_json_object_regex_and_ebnf(server):
    client = server.openai()
    # Any object: nothing bounds its length, so a cut-off one is only checked to begin as one.
    text, reason = await chat_text(client, server.model, False, 12, response_format={"type": "json_object"})
    assert text.startswith("{") and (reason == "length" or isinstance(json.loads(text), dict)), text

    pattern = r"(yes|no), because [a-z ]{1,24}\."
    for stream in (False, True):
        text, reason = await chat_text(
            client, server.model, stream, 40, response_format={"type": "regex", "regex": pattern}
        )
        assert re.fullmatch(pattern, text) and reason == "stop", text

    grammar = 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'
    out = await client.completions.create(
        model=server.model, prompt="Pick a number.", temperature=0, max_tokens=16,
        extra_body={"response_format": {"type": "ebnf", "ebnf": grammar}},
    )
    assert re.fullmatch(r"The answer is [0-9]{1,2}\.", out.choices[0].text), out.choices[0].text


@pytest.mark.parametrize("response_format, param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "response_format"),
    ({"type": "regex", "regex": "(unclosed"}, "response_format"),
    ({"type": "ebnf", "ebnf": "root ::= undefined_rule"}, "response_format"),
    ({"type": "regex"}, "response_format.regex"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    # unsatisfiable: no output can begin (it ran to content "" with finish_reason "stop")
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}, "response_format"),
    ({"type": "ebnf", "ebnf": "root ::= a\na ::= root"}, "response_format"),
    # unsatisfiable deeper down: each output may begin, none may end (it ran to its length limit)
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"$ref": "#"}, "minItems": 1}}}, "response_format"),
    ({"type": "ebnf", "ebnf": 'root ::= "(" root ")" | "[" root "]"'}, "response_format"),
])
async def test_a_spec_that_cannot_compile_is_a_400(server, response_format, param):
    with pytest.raises(openai.BadRequestError) as info:
        await server.openai().chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": ASK}], response_format=response_format
        )
    assert info.value.status_code == 400
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"


async def test_unconstrained_requests_in_a_constrained_batch_are_unchanged(server):
    client = server.openai()
    prompts = ["The capital of France is", "One, two, three,", "Once upon a time"]
    short_schemas = [SCHEMAS[1], SCHEMAS[2], SCHEMAS[16]]  # each done in a few tokens
    args = dict(model=server.model, max_tokens=12, temperature=0)
    alone = [(await client.completions.create(prompt=p, **args)).choices[0].text for p in prompts]
    together = {}

    async def free(i: int) -> None:
        together[i] = (await client.completions.create(prompt=prompts[i], **args)).choices[0].text

    async def constrained(i: int) -> None:
        # n = 2: each sample has its own matcher (a shared one would see every token twice).
        out = await client.completions.create(
            prompt=prompts[i], **args, n=2, extra_body={"response_format": json_schema_format(short_schemas[i])}
        )
        together["json", i] = [(c.text, c.finish_reason) for c in out.choices]

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(free, i)
            nursery.start_soon(constrained, i)
    assert [together[i] for i in range(len(prompts))] == alone
    for i in range(len(prompts)):
        for text, finish_reason in together["json", i]:
            assert finish_reason == "stop", text
            jsonschema.validate(json.loads(text), short_schemas[i])
