"""Tools in a chat request: how they reach the prompt, and what `tool_choice` makes of the output.

  none          the tools are not shown to the model; the answer is text.
  auto          the tools are shown; the server's tool-call parser picks calls out of the
                text (`--tool-call-parser`, else the one the chat template implies, see
                trillm.http.tool_parsers.default_parser; with `none`, auto is refused:
                nothing would read the calls).
  required      the output is constrained (structured output) to exactly one call of one of
                the tools: `{"name": <a tool's name>, "arguments": <its parameters>}`.
  a function    the output is constrained to that function's arguments object.

A chat template that knows tools (it mentions `tools`) renders them itself; for one that
does not (SmolLM2's), the tools go into the system message in the Hermes format below, and
earlier calls into their assistant turns as `<tool_call>` blocks, so the conversation reads
the same way the hermes parser reads the answer. Required and named choices make one call;
under auto, `parallel_tool_calls: false` keeps the first call the model wrote and drops the
rest (trillm.http.chat_output).
"""
from __future__ import annotations

import json
from dataclasses import replace

from trillm.http.protocol.chat import ChatCompletionRequest, NamedToolChoice, Tool
from trillm.http.tool_parsers import HermesParser
from trillm.sampling_params import SamplingParamError, SamplingParams, StructuredOutput

TOOLS_PREAMBLE = (
    "You may call functions to help with the user's request. The functions, as JSON schemas, "
    "are listed inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call one, reply with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, like this:\n<tool_call>\n"
    '{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n</tool_call>'
)


def tool_choice(req: ChatCompletionRequest, parser: str | None,
                params: SamplingParams) -> tuple[str | NamedToolChoice, SamplingParams]:
    """The request's effective choice ("none", "auto", "required" or a named function), checked,
    and its sampling params, constrained to a call for required and named choices."""
    choice = _checked_choice(req, parser, params)
    forced = _forced_call_constraint(req.tools or [], choice)
    return choice, params if forced is None else replace(params, structured_output=forced)


def _checked_choice(req: ChatCompletionRequest, parser: str | None, params: SamplingParams) -> str | NamedToolChoice:
    tools = req.tools or []
    choice = req.tool_choice or ("auto" if tools else "none")
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise SamplingParamError(
            "tool_choice", f"tool_choice must be none, auto, required or a named function, got {choice!r}."
        )
    if choice == "none":
        return choice
    if not tools:
        raise SamplingParamError("tool_choice", f"tool_choice {_label(choice)} needs tools.")
    if choice == "auto" and parser is None:
        raise SamplingParamError(
            "tool_choice", "tool_choice auto needs a tool-call parser, and this server has none "
            "(--tool-call-parser); use required, a named function, or none."
        )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
        raise SamplingParamError("tool_choice", f"tool_choice names {choice.function.name!r}, which is not in tools.")
    if choice != "auto" and params.structured_output is not None:
        param = params.structured_output.param
        raise SamplingParamError(param, f"{param} cannot be combined with tool_choice {_label(choice)}.")
    return choice


def _forced_call_constraint(tools: list[Tool], choice: str | NamedToolChoice) -> StructuredOutput | None:
    """The grammar that makes the output a call, for required and named choices; else None."""
    if isinstance(choice, NamedToolChoice):
        (tool,) = [t for t in tools if t.function.name == choice.function.name]
        return StructuredOutput.from_schema(_parameters(tool), strict=tool.function.strict is not False, param="tool_choice")
    if choice == "required":
        calls = [
            {"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
             "required": ["name", "arguments"]}
            for t in tools
        ]
        return StructuredOutput.from_schema({"anyOf": calls}, param="tools")
    return None


def template_inputs(template: str | None, messages: list[dict], tools: list[Tool] | None) -> tuple[list[dict], dict]:
    """(messages, extra template kwargs) that show the tools to the model, for this chat template."""
    if not tools:
        return messages, {}
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools]
    if "tools" in (template or ""):
        return messages, {"tools": tool_dicts}
    preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tool_dicts))
    messages = [_calls_as_text(m) for m in messages]
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{preamble}"}, *messages[1:]], {}
    return [{"role": "system", "content": preamble}, *messages], {}


def _calls_as_text(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [
        f"{HermesParser.START}\n"
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
        + f"\n{HermesParser.END}"
        for c in calls
    ]
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": "\n".join(filter(None, [message["content"], *blocks]))}


def _parameters(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _label(choice: str | NamedToolChoice) -> str:
    return choice if isinstance(choice, str) else f"function {choice.function.name!r}"
