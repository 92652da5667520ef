"""The peers' spellings of structured output, against a live server on the default model: vLLM's
`structured_outputs` and `guided_*` fields, TensorRT-LLM's `json` and `structural_tag` response
formats, LMDeploy's `regex_schema`, and the older structural tag of vLLM and SGLang. Each is
judged by what it does to the output: the constraints are ones a greedy unconstrained answer
does not meet (an odd choice, a fixed shape), so a spelling that were only accepted would fail."""
import json
import re

import jsonschema
import openai
import pytest

ASK = [{"role": "user", "content": "Describe a city you like."}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "rank"]}
CHOICES = ["zebra-7", "quartz-9"]
PATTERN = r"Rating: [1-5]/5 \([a-z]{2,10}\)"
GRAMMAR = 'root ::= "Pick " [0-9] [0-9] "!"'
TAG = {"type": "tag", "begin": "<city>", "content": {"type": "json_schema", "json_schema": CITY}, "end": "</city>"}


def is_city(text: str) -> bool:
    jsonschema.validate(json.loads(text), CITY)
    return True


def is_tagged_city(text: str) -> bool:
    match = re.fullmatch(r"<city>(.*)</city>", text, re.S)
    return bool(match) and is_city(match.group(1))


SPELLINGS = [
    ({"structured_outputs": {"json": CITY}}, is_city),
    ({"structured_outputs": {"json": json.dumps(CITY)}}, is_city),
    ({"structured_outputs": {"regex": PATTERN}}, lambda t: re.fullmatch(PATTERN, t)),
    ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
    ({"structured_outputs": {"grammar": GRAMMAR}}, lambda t: re.fullmatch(r"Pick [0-9]{2}!", t)),
    ({"structured_outputs": {"json_object": True}}, lambda t: t.startswith("{")),  # unbounded: may be cut
    ({"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": TAG})}},
     is_tagged_city),
    ({"guided_json": CITY}, is_city),
    ({"guided_regex": PATTERN}, lambda t: re.fullmatch(PATTERN, t)),
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    ({"guided_grammar": GRAMMAR}, lambda t: re.fullmatch(r"Pick [0-9]{2}!", t)),
    ({"response_format": {"type": "json", "schema": CITY}}, is_city),  # TensorRT-LLM
    ({"response_format": {"type": "structural_tag", "format": TAG}}, is_tagged_city),  # TensorRT-LLM, vLLM
    ({"response_format": {"type": "regex_schema", "regex_schema": PATTERN}},  # LMDeploy
     lambda t: re.fullmatch(PATTERN, t)),
]


@pytest.mark.parametrize("extra, holds", SPELLINGS, ids=lambda v: next(iter(v)) if isinstance(v, dict) else "")
async def test_each_spelling_constrains_chat_and_completions(server, extra, holds):
    client = server.openai()
    chat = await client.chat.completions.create(model=server.model, messages=ASK, temperature=0, max_tokens=48,
                                                extra_body=extra)
    text = await client.completions.create(model=server.model, prompt="My favourite city:", temperature=0,
                                           max_tokens=48, extra_body=extra)
    bounded = "json_object" not in json.dumps(extra)
    for choice, output in ((chat.choices[0], chat.choices[0].message.content), (text.choices[0], text.choices[0].text)):
        assert holds(output) and (choice.finish_reason == "stop" or not bounded), output


async def test_the_older_structural_tag_constrains_what_follows_each_trigger(server):
    """Free text until a trigger, then the structure its begin opens. A logit bias makes "<" (the
    trigger) the model's every free choice, so without the tag the output would be "<<<<"."""
    lt = server.state.tokenizer.encode("<")[0]
    zone = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
    tag = {"type": "structural_tag", "structures": [{"begin": "<", "schema": zone, "end": ">"}], "triggers": ["<"]}
    out = await server.openai().chat.completions.create(
        model=server.model, messages=ASK, temperature=0, max_tokens=48, logit_bias={str(lt): 100},
        response_format=tag,
    )
    text = out.choices[0].message.content
    regions = re.findall(r"<(\{.*?\})>", text, re.S)
    assert len(regions) >= 2 and text.startswith("<{"), text
    for region in regions:
        jsonschema.validate(json.loads(region), zone)


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"structural_tag": '{"type": "regex"}'}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": {"type": "bogus"}})}},
     "structured_outputs.structural_tag"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {"type": "json"}}, "response_format.schema"),
    ({"response_format": {"type": "regex_schema"}}, "response_format.regex_schema"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar"),
])
async def test_conflicting_or_bad_specs_are_400s_naming_the_field(server, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        await server.openai().chat.completions.create(model=server.model, messages=ASK, max_tokens=4,
                                                      extra_body=extra)
    assert info.value.body["param"] == param, info.value.body
