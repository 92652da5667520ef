"""The body of POST /v1/responses, and its translation into the chat machinery.

A Responses request is a chat request in other words: its `input` items (messages with
`input_text` parts, earlier `function_call`s and their `function_call_output`s), `instructions`,
`tools` in the flat Responses shape, `text.format` and `reasoning.effort` become a
ChatCompletionRequest, which then takes the chat path's own checks, template, tool handling and
sampling params. Items are kept as given (with ids) for GET .../input_items.
"""
from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt

from trillm.http.protocol.chat import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolCallMessage,
)
from trillm.http.protocol.common import MAX_LIST_ITEMS, MAX_TOOLS, Strict
from trillm.http.protocol.structured import JSONSchemaFormat, ResponseFormat
from trillm.sampling_params import SamplingParamError

# What a client's Responses field is called on the chat path, so a refusal names the client's field.
FIELD_NAMES = {
    "messages": "input", "prompt": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
    "tools": "tools", "tool_choice": "tool_choice", "logprobs": "top_logprobs",
}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class InputText(Strict):
    type: Literal["input_text"]
    text: str


class OutputText(Strict):
    """An earlier answer's text, as a client sends `response.output` back as input."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Item(Strict):
    """What any input item may carry: the id and status it had as an output item, when a client
    sends an earlier `response.output` back."""

    id: str | None = None
    status: str | None = None


class MessageItem(Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[Annotated[InputText | OutputText, Field(discriminator="type")]],
                             Field(max_length=MAX_LIST_ITEMS)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningText(Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Item):
    """An earlier answer's reasoning; chat templates drop it, as they drop reasoning_content."""

    type: Literal["reasoning"]
    summary: list[Any] = Field(default_factory=list, max_length=MAX_LIST_ITEMS)
    content: list[ReasoningText] | None = Field(None, max_length=MAX_LIST_ITEMS)
    encrypted_content: str | None = None


class FunctionTool(Strict):
    """A function tool in the Responses shape: chat's function definition, flat, its type first
    (so a tool of another type is refused for its type)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; a small model has one voice


class Reasoning(Strict):
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(Strict):
    include_obfuscation: bool | None = None  # accepted; trillm pads no events


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | Annotated[list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem],
                           Field(max_length=MAX_LIST_ITEMS)]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: StrictBool = False
    stream_options: ResponsesStreamOptions | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    background: bool = False
    include: list[str] | None = None  # nothing optional to include here: accepted, no effect

    def items(self) -> list:
        """The input as items, a string being one user message."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def to_chat(self, earlier: list[ChatMessage], stream: bool) -> ChatCompletionRequest:
        """The equivalent chat request: `earlier` (a previous response's turns) first, then the
        instructions as the system message, then this request's items."""
        messages = list(earlier)
        if self.instructions:
            messages.insert(0, ChatMessage(role="system", content=self.instructions))
        messages += items_to_messages(self.items())
        tool_choice = self.tool_choice
        if isinstance(tool_choice, FunctionToolChoice):
            tool_choice = NamedToolChoice(type="function", function=NamedFunction(name=tool_choice.name))
        return ChatCompletionRequest(
            messages=messages,
            model=self.model,
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            tools=[Tool(type="function", function=FunctionDefinition(**t.model_dump(exclude={"type"})))
                   for t in self.tools] if self.tools else None,
            tool_choice=tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self._response_format(),
            reasoning_effort=self.reasoning.effort if self.reasoning else None,
            metadata=self.metadata,
            user=self.user,
            stream=stream,
        )

    def _response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        if fmt.schema_ is None:  # as chat's response_format needs its json_schema
            raise SamplingParamError("text.format.schema", "A text.format of type json_schema needs a schema.")
        return ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(
            name=fmt.name or "response", description=fmt.description, schema=fmt.schema_, strict=fmt.strict,
        ))


def items_to_messages(items: list) -> list[ChatMessage]:
    """Responses items as chat messages: consecutive function calls are one assistant turn with
    tool_calls, each output a tool message; reasoning items are dropped (templates drop it too)."""
    messages: list[ChatMessage] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = ToolCallMessage(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls:
                last.tool_calls.append(call)
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
    return messages


def with_ids(items: list) -> list[dict]:
    """The items as stored for input_items: each with an id (one is made where the client gave none)."""
    out = []
    for item in items:
        data = item.model_dump(exclude_none=True, by_alias=True)
        data.setdefault("type", "message")
        data.setdefault("id", item_id({"message": "msg", "function_call": "fc", "function_call_output": "fco",
                                       "reasoning": "rs"}[data["type"]]))
        if data["type"] == "message" and isinstance(data["content"], str):
            data["content"] = [{"type": "input_text", "text": data["content"]}]
        out.append(data)
    return out
