"""The body of Anthropic's POST /v1/messages (and /v1/messages/count_tokens), and its
translation into the chat machinery.

A Messages request is a chat request in other words, as a Responses request is: `system` (a
string or text blocks) becomes the system message; each turn's content blocks become chat turns
(text joined; an assistant's `tool_use` blocks its tool_calls, their `input` as JSON arguments;
a user's `tool_result` blocks tool messages, in their order, before the turn's text; `thinking`
the reasoning a template drops); `tools` with `input_schema` become function tools; `tool_choice`
`auto` / `any` / `tool` / `none` become chat's auto / required / a named function / none, and
`disable_parallel_tool_use` parallel_tool_calls false; a last assistant turn of text is a
prefill, which the answer continues (chat's continue_final_message); `thinking` becomes the template's thinking
switch; `output_config` its JSON schema (enforced as json_schema is) and reasoning effort. The
ChatCompletionRequest then takes the chat path's own checks, template, tool handling and params.

Fields the SDKs send that have nothing to do here (`cache_control`: the prefix cache needs no
marks; `service_tier`, `speed`, `inference_geo`, `container`, `diagnostics`, `user_profile_id`,
`workspace_id`) are accepted and change nothing. Image, document and search-result blocks are a
400 that says this model reads text only; any other unknown field or block is a 400, as on every
route.
"""
from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

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

# What a client's Messages field is called on the chat path, so a refusal names the client's field.
FIELD_NAMES = {"prompt": "messages", "stop": "stop_sequences", "response_format": "output_config.format",
               "reasoning_effort": "output_config.effort"}
# Anthropic's efforts beyond chat's names: its top one is chat's strongest.
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex}"


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = Field(None, max_length=MAX_LIST_ITEMS)


class MediaBlock(BaseModel):
    """An image, a document or a search result: valid Anthropic, refused by a text-only model
    with a message that says so (not a schema error listing every block type)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document", "search_result", "container_upload"]


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | Annotated[list[Annotated[TextBlock | MediaBlock, Field(discriminator="type")]],
                             Field(max_length=MAX_LIST_ITEMS)] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return _texts(self.content)


class ThinkingBlock(Strict):
    """An earlier answer's reasoning; chat templates drop it, as they drop reasoning_content."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | MediaBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


def _texts(blocks: list) -> str:
    """The text of text blocks; a media block is refused by name."""
    media = [b.type for b in blocks if isinstance(b, MediaBlock)]
    if media:
        raise SamplingParamError("messages", f"This model takes text only; a message holds a {media[0]} block. "
                                             "Send text blocks.")
    return "".join(b.text for b in blocks if isinstance(b, TextBlock))


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(max_length=MAX_LIST_ITEMS)]

    def to_chat(self) -> list[ChatMessage]:
        if isinstance(self.content, str):
            return [ChatMessage(role=self.role, content=self.content)]
        if self.role == "assistant":
            calls = [ToolCallMessage(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input)))
                     for b in self.content if isinstance(b, ToolUseBlock)]
            reasoning = "".join(b.thinking for b in self.content if isinstance(b, ThinkingBlock))
            text = _texts(self.content)
            return [ChatMessage(role="assistant", content=text or (None if calls else ""), tool_calls=calls or None,
                                reasoning_content=reasoning or None)]
        turns = [ChatMessage(role="tool", content=b.text(), tool_call_id=b.tool_use_id)
                 for b in self.content if isinstance(b, ToolResultBlock)]
        if any(isinstance(b, (ToolUseBlock, ThinkingBlock, RedactedThinkingBlock)) for b in self.content):
            raise SamplingParamError("messages", "A user turn holds text and tool_result blocks; tool_use and "
                                                 "thinking blocks belong to assistant turns.")
        text = _texts(self.content)
        if text or not turns:
            turns.append(ChatMessage(role="user", content=text))
        return turns


class AnthropicTool(Strict):
    """A client tool. Anthropic's server tools (web search, code execution, ...) have other types
    and are refused as unknown here: this server runs none of them."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None
    # Anthropic's, about its own tool runner: accepted, no effect here.
    allowed_callers: list[str] | None = Field(None, max_length=MAX_LIST_ITEMS)
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = Field(None, max_length=MAX_LIST_ITEMS)


class ToolChoiceAuto(Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Strict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Strict):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(Strict):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)  # accepted; the answer is bounded by max_tokens as a whole
    display: str | None = None


class ThinkingAdaptive(Strict):
    type: Literal["adaptive"]
    display: str | None = None


class ThinkingDisabled(Strict):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class JSONOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JSONOutputFormat | None = None


class Metadata(Strict):
    user_id: str | None = None


class CountTokensRequest(Strict):
    """What both routes read to build the prompt: count_tokens takes this much."""

    model: str
    messages: Annotated[list[Message], Field(max_length=MAX_LIST_ITEMS)]
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_LIST_ITEMS)] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: JSONOutputFormat | None = None  # the older name of output_config.format
    # Accepted, no effect (module docstring).
    cache_control: CacheControl | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    def to_chat(self, stream: bool = False, **chat) -> ChatCompletionRequest:
        """The equivalent chat request (`chat`: the sampling fields Messages adds)."""
        messages = []
        if self.system:
            system = self.system if isinstance(self.system, str) else _texts(self.system)
            messages.append(ChatMessage(role="system", content=system))
        for message in self.messages:
            messages += message.to_chat()
        # A last assistant turn of text is a prefill: the answer continues it (Anthropic's).
        prefill = bool(messages) and messages[-1].role == "assistant" and not messages[-1].tool_calls
        tool_choice, parallel = _tool_choice(self.tool_choice)
        thinking = None if self.thinking is None else self.thinking.type != "disabled"
        effort = self.output_config.effort if self.output_config else None
        return ChatCompletionRequest(
            messages=messages,
            model=self.model,
            tools=[Tool(type="function", function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.input_schema, strict=t.strict))
                for t in self.tools] if self.tools else None,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel,
            response_format=self._response_format(),
            reasoning_effort=EFFORTS[effort] if effort else None,
            enable_thinking=thinking,
            continue_final_message=prefill,
            add_generation_prompt=not prefill,
            stream=stream,
            **chat,
        )

    def _response_format(self) -> ResponseFormat | None:
        fmt = (self.output_config.format if self.output_config else None) or self.output_format
        if fmt is None:
            return None
        return ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(name="output", schema=fmt.schema_))


def _tool_choice(choice) -> tuple[str | NamedToolChoice | None, bool | None]:
    """Anthropic's tool_choice as chat's tool_choice and parallel_tool_calls."""
    if choice is None:
        return None, None
    parallel = None if isinstance(choice, ToolChoiceNone) or not choice.disable_parallel_tool_use else False
    if isinstance(choice, ToolChoiceTool):
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name)), parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_LIST_ITEMS)
    stream: StrictBool = False
    # Anthropic's own API no longer takes these; older clients and llama.cpp's users send them.
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    # Accepted, no effect (module docstring).
    service_tier: str | None = None
    inference_geo: str | None = None
    container: str | dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None

    def chat(self) -> ChatCompletionRequest:
        return self.to_chat(
            stream=self.stream, max_tokens=self.max_tokens, stop=self.stop_sequences, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, user=self.metadata.user_id if self.metadata else None,
        )
