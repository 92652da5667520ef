"""The reasoning and tool-call parsers on fixed strings: fed whole, or a character at a time as a
stream may cut it, they give the same reasoning, content and calls."""
import json

import pytest

from trillm.http.reasoning import reasoning_parser
from trillm.http.tool_parsers import TOOL_PARSERS


def run(parser, pieces: list[str]) -> tuple[list, list]:
    """Every feed's and the finish's outputs, in order."""
    outputs = [parser.feed(p) for p in pieces] + [parser.finish()]
    return [o[0] for o in outputs], [o[1] for o in outputs]


def split_ways(text: str) -> list[list[str]]:
    return [[text], list(text), [text[:3], text[3:9], text[9:]]]


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("deepseek_r1", "<think>plan it</think>\n\nThe answer.", "plan it", "The answer."),
    ("deepseek_r1", "plan it</think>The answer.", "plan it", "The answer."),  # the template opened <think>
    ("deepseek_r1", "still thinking", "still thinking", ""),  # cut off inside the reasoning
    ("qwen3", "<think>plan it</think>\n\nThe answer.", "plan it", "The answer."),
    ("qwen3", "No thinking here </think> at all", "", "No thinking here </think> at all"),
    ("qwen3", "<thin", "", "<thin"),  # a tag that never completed is text
    ("qwen3", "<think>a < b, and </thinking> is not the end</think>ok", "a < b, and </thinking> is not the end",
     "ok"),
])
def test_reasoning_parser(name, text, reasoning, content):
    for pieces in split_ways(text):
        reasonings, contents = run(reasoning_parser(name), pieces)
        assert "".join(reasonings) == reasoning and "".join(contents) == content, pieces


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", f"Sure.\n<tool_call>\n{CALL}\n</tool_call>", "Sure.\n", [("get_weather", {"city": "Paris"})]),
    ("hermes", f"<tool_call>{CALL}</tool_call>\n<tool_call>{CALL}</tool_call>", "\n",
     [("get_weather", {"city": "Paris"})] * 2),
    ("hermes", f"<tool_call>{CALL}", "", [("get_weather", {"city": "Paris"})]),  # no end tag, whole JSON
    ("hermes", "<tool_call>{not json}</tool_call> and <tool", "<tool_call>{not json}</tool_call> and <tool", []),
    ("hermes", "a < b <tool_c", "a < b <tool_c", []),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}', "", [("f", {"x": 1})]),
    ("llama3_json", '{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"y": [2]}}', "",
     [("f", {}), ("g", {"y": [2]})]),
    ("llama3_json", "  Plain {text}", "  Plain {text}", []),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1', '{"name": "f", "parameters": {"x": 1', []),  # cut off
    ("llama3_json", '{"title": "not a call"}', '{"title": "not a call"}', []),
])
def test_tool_parser(name, text, content, calls):
    for pieces in split_ways(text):
        contents, found = run(TOOL_PARSERS[name](), pieces)
        assert "".join(contents) == content, pieces
        got = [(c.name, json.loads(c.arguments)) for batch in found for c in batch]
        assert got == calls, pieces
        ids = [c.id for batch in found for c in batch]
        assert len(set(ids)) == len(ids)


HUGE = "9" * 5_000  # an integer longer than Python converts (sys.get_int_max_str_digits)


@pytest.mark.parametrize("name, text", [
    ("hermes", f'<tool_call>{{"name": "f", "arguments": {{"x": {HUGE}}}}}</tool_call>'),
    ("llama3_json", f'{{"name": "f", "parameters": {{"x": {HUGE}}}}}'),
])
def test_a_call_holding_an_integer_too_long_to_convert_is_text(name, text):
    """json.loads raises a bare ValueError on such an integer, not a JSONDecodeError: read as no
    call (the text stays content), never as an exception that ends the response in a 500."""
    for pieces in split_ways(text):
        contents, found = run(TOOL_PARSERS[name](), pieces)
        assert "".join(contents) == text and not any(found), pieces


def test_a_required_call_holding_an_integer_too_long_to_convert_is_text():
    from trillm.http.chat_output import ForcedCall

    text = f'{{"name": "f", "arguments": {{"x": {HUGE}}}}}'
    required = ForcedCall(None)
    assert required.feed(text) == ("", [])
    assert required.finish() == (text, [])


def test_hermes_content_before_a_call_streams_before_it_completes():
    parser = TOOL_PARSERS["hermes"]()
    assert parser.feed("Checking <tool") == ("Checking ", [])  # "<tool" may begin a call: held
    assert parser.feed("_call>{") == ("", [])
    content, calls = parser.feed('"name": "f", "arguments": {}}</tool_call> done')
    assert content == " done" and [c.name for c in calls] == ["f"]
