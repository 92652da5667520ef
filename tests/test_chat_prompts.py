"""Chat prompts with the default model's tokenizer under templates of other model families: what a
request puts in `chat_template_kwargs` and `tools` reaches the template, and a template without
tools gets them in its system message."""
import copy

import pytest
from transformers import AutoTokenizer

from trillm.http.prompts import chat_prompt
from trillm.http.protocol.common import TemplateOptions
from trillm.http.protocol.chat import ChatMessage, Tool
from trillm.http.tools import TOOLS_PREAMBLE

# A Qwen3-like template, cut to what these tests look at.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
)
TOOL = Tool.model_validate({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}})
ASK = [ChatMessage(role="user", content="What time is it?")]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def thinking_tokenizer(tokenizer):
    other = copy.deepcopy(tokenizer)
    other.chat_template = THINKING_TEMPLATE
    return other


def text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids)


def test_enable_thinking_reaches_the_template(thinking_tokenizer):
    off = text(thinking_tokenizer, chat_prompt(thinking_tokenizer, ASK, TemplateOptions({"enable_thinking": False})))
    on = text(thinking_tokenizer, chat_prompt(thinking_tokenizer, ASK, TemplateOptions({"enable_thinking": True})))
    assert off.endswith("<think>\n\n</think>\n\n") and not on.endswith("</think>\n\n")


def test_a_template_that_knows_tools_renders_them(thinking_tokenizer):
    prompt = text(thinking_tokenizer, chat_prompt(thinking_tokenizer, ASK, tools=[TOOL]))
    assert '<tools>[{"type": "function", "function": {"name": "get_time"' in prompt
    assert "<tool_call>" not in prompt  # our own preamble is only for templates without tools


def test_a_template_without_tools_gets_them_in_the_system_message(tokenizer):
    assert "tools" not in tokenizer.chat_template
    history = [
        ChatMessage(role="system", content="Be brief."),
        *ASK,
        ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}),
        ChatMessage(role="tool", content="12:00", tool_call_id="call_1"),
    ]
    prompt = text(tokenizer, chat_prompt(tokenizer, history, tools=[TOOL]))
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n" + TOOLS_PREAMBLE.split("{tools}")[0])
    assert '"name": "get_time"' in system
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in prompt
    assert prompt.count("<|im_start|>system") == 1
