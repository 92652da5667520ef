"""The bodies of Ollama's API (/api/chat, /api/generate, /api/embed, /api/embeddings, /api/show)
and their translation into the chat and completion machinery.

An Ollama chat is a chat request in other words, as an Anthropic message is: each message's
`role`, `content`, `thinking` (an earlier answer's reasoning), `tool_calls` (arguments as an
object) and `tool_name` / `tool_call_id` become chat turns; `tools` are chat's function tools under
tool_choice auto; `format` "json" or a schema becomes a response_format; `think` the template's
thinking switch or reasoning effort. The route validates that body as a ChatCompletionRequest,
which then takes the chat path's own
checks, template, tool handling and params. A generate request is the same chat of one user
turn (and its `system`), or with `raw` the prompt as it is.

`options` are checked one by one: the sampling options trillm runs are honoured (num_predict is
max_tokens, repeat_penalty the repetition penalty over the whole context); `num_ctx` bounds
prompt and answer together and may not exceed the served context; sampling options trillm does not
run (mirostat, typical_p, tfs_z, a repeat_last_n window) are refused unless they hold their
neutral value; options that choose how Ollama loads a model (num_gpu, num_thread, use_mmap, ...)
are accepted and change nothing, since the served model was loaded once, from the command line.
`keep_alive` is accepted likewise: the model stays loaded for the server's life. Any other
unknown field or option is a 400, as on every route. Images are refused: this model reads text.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt, field_validator

from trillm.http.protocol.chat import ChatMessage, FunctionCall, ToolCallMessage
from trillm.http.protocol.common import MAX_LIST_ITEMS, MAX_TOOLS, Strict
from trillm.sampling_params import SamplingParamError

# What the chat path calls a client's Ollama field, so a refusal names the client's field.
FIELD_NAMES = {"max_tokens": "options.num_predict", "temperature": "options.temperature", "top_p": "options.top_p",
               "top_k": "options.top_k", "min_p": "options.min_p", "seed": "options.seed", "stop": "options.stop",
               "repetition_penalty": "options.repeat_penalty", "presence_penalty": "options.presence_penalty",
               "frequency_penalty": "options.frequency_penalty", "response_format": "format",
               "reasoning_effort": "think", "tool_choice": "tools"}
# Ollama's thinking levels as chat's reasoning efforts (its top one is chat's strongest).
THINK_LEVELS = {"low": "low", "medium": "medium", "high": "high", "max": "xhigh"}
Think = StrictBool | Literal["low", "medium", "high", "max"]


class Options(Strict):
    """Ollama's Modelfile parameters, as a request's `options` carry them."""

    # honoured
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    seed: StrictInt | None = None
    num_predict: StrictInt | None = None  # -1: until the context ends; -2: fill the context
    stop: list[str] | None = Field(None, max_length=MAX_LIST_ITEMS)
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: StrictInt | None = Field(None, ge=1)
    # sampling trillm does not run: only their neutral values
    repeat_last_n: StrictInt | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: StrictInt | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: StrictBool | None = None
    # how Ollama loads a model: the served model was loaded once, from the command line
    num_keep: StrictInt | None = None
    num_batch: StrictInt | None = None
    num_gpu: StrictInt | None = None
    main_gpu: StrictInt | None = None
    num_thread: StrictInt | None = None
    draft_num_predict: StrictInt | None = None
    numa: StrictBool | None = None
    low_vram: StrictBool | None = None
    f16_kv: StrictBool | None = None
    logits_all: StrictBool | None = None
    vocab_only: StrictBool | None = None
    use_mmap: StrictBool | None = None
    use_mlock: StrictBool | None = None
    embedding_only: StrictBool | None = None

    def sampling(self) -> dict[str, Any]:
        """The chat fields these options set; a sampling option trillm does not run is refused."""
        unsupported = {"typical_p": (self.typical_p, 1.0), "tfs_z": (self.tfs_z, 1.0), "mirostat": (self.mirostat, 0),
                       "penalize_newline": (self.penalize_newline, True)}
        for name, (value, neutral) in unsupported.items():
            if value is not None and value != neutral:
                raise SamplingParamError(f"options.{name}", f"options.{name} is not supported by this server; "
                                                            f"leave it out, or send {json.dumps(neutral)}.")
        if self.repeat_last_n not in (None, -1) and self.repeat_penalty not in (None, 1.0):
            raise SamplingParamError("options.repeat_last_n", "This server's repeat_penalty covers the whole "
                                                              "context: send repeat_last_n -1, or leave it out.")
        fields = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                  "seed": self.seed, "stop": self.stop, "repetition_penalty": self.repeat_penalty,
                  "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty}
        if self.num_predict is not None and self.num_predict >= 0:  # below 0: as long as the context allows
            fields["max_tokens"] = self.num_predict
        return {k: v for k, v in fields.items() if v is not None}


class ToolCallFunction(Strict):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: StrictInt | None = None


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunction


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = Field(None, max_length=MAX_LIST_ITEMS)
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_name: str | None = None
    tool_call_id: str | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _lower_role(cls, role):
        return role.lower() if isinstance(role, str) else role  # as Ollama reads it


def refuse_images(images: list[str] | None, param: str) -> None:
    if images:
        raise SamplingParamError(param, "This model takes text only; the request holds images. Send text.")


def format_field(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """`format` as chat's response_format: "json" any JSON object, a schema that schema."""
    if value is None or value == "":
        return {}
    if value == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(value, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}}
    raise SamplingParamError("format", 'format must be "json" or a JSON schema object.')


class Generating(Strict):
    """What /api/chat and /api/generate share."""

    model: str = ""
    stream: StrictBool = True  # Ollama streams unless told not to
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: float | str | None = None  # accepted: the model stays loaded for the server's life
    think: Think | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt = Field(0, ge=0, le=20)
    truncate: StrictBool | None = None
    shift: StrictBool | None = None

    @property
    def num_ctx(self) -> int | None:
        return None if self.options is None else self.options.num_ctx

    def chat_fields(self, turns: list[ChatMessage]) -> dict[str, Any]:
        """A ChatCompletionRequest's body: `turns`, and the fields for options, format, think and logprobs."""
        fields = {"messages": turns, "model": self.model, **(self.options.sampling() if self.options else {}),
                  **format_field(self.format)}
        if isinstance(self.think, bool):
            fields["enable_thinking"] = self.think
        elif self.think is not None:
            fields["reasoning_effort"] = THINK_LEVELS[self.think]
        if self.logprobs:
            fields.update(logprobs=True, top_logprobs=self.top_logprobs)
        return fields


class ChatRequest(Generating):
    messages: list[Message] = Field(default_factory=list, max_length=MAX_LIST_ITEMS)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)

    def chat_body(self) -> dict[str, Any]:
        """The ChatCompletionRequest's body (the route validates it)."""
        turns: list[ChatMessage] = []
        calls: dict[str, str] = {}  # a tool's name -> the id of the last call to it (Ollama's results name the tool)
        for k, message in enumerate(self.messages):
            refuse_images(message.images, f"messages.{k}.images")
            tool_calls = None
            if message.tool_calls:
                tool_calls = []
                for j, call in enumerate(message.tool_calls):
                    call_id = call.id or f"call_{k}_{j}"
                    calls[call.function.name] = call_id
                    tool_calls.append(ToolCallMessage(id=call_id, function=FunctionCall(
                        name=call.function.name, arguments=json.dumps(call.function.arguments))))
            tool_call_id = message.tool_call_id
            if message.role == "tool" and tool_call_id is None and message.tool_name is not None:
                tool_call_id = calls.get(message.tool_name)
            turns.append(ChatMessage(
                role=message.role, content=message.content if message.content or not tool_calls else None,
                name=message.tool_name if message.role == "tool" else None, tool_calls=tool_calls,
                tool_call_id=tool_call_id if message.role == "tool" else None, reasoning_content=message.thinking))
        body = self.chat_fields(turns)
        if self.tools:
            body["tools"] = self.tools
        return body


class GenerateRequest(Generating):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[StrictInt] | None = Field(None, max_length=1 << 20)
    raw: StrictBool = False
    images: list[str] | None = Field(None, max_length=MAX_LIST_ITEMS)

    def check(self) -> None:
        refuse_images(self.images, "images")
        if self.suffix:
            raise SamplingParamError("suffix", "This model does not support insert (a suffix after the answer).")
        if self.template:
            raise SamplingParamError("template", "A request's own template is not supported: the model's chat "
                                                 "template renders the prompt (or send raw: true).")
        if self.raw and (self.system or self.context):
            raise SamplingParamError("raw", "raw mode does not support system or context.")

    def chat_body(self) -> dict[str, Any]:
        """The ChatCompletionRequest's body (the route validates it): the prompt as one user turn
        after `system`, which the model's template renders; with `raw` the template renders
        nothing, and the body carries the sampling fields alone (the route tokenizes the prompt)."""
        if self.raw:
            return self.chat_fields([ChatMessage(role="user", content="")])
        turns = ([ChatMessage(role="system", content=self.system)] if self.system else []) + \
            [ChatMessage(role="user", content=self.prompt)]
        return self.chat_fields(turns)


class EmbedRequest(Strict):
    model: str = ""
    input: str | Annotated[list[str], Field(max_length=MAX_LIST_ITEMS)]
    truncate: StrictBool = True
    dimensions: StrictInt | None = Field(None, ge=1)
    options: Options | None = None
    keep_alive: float | str | None = None


class EmbeddingsRequest(Strict):
    """The older /api/embeddings: one prompt, its vector as the model makes it (not normalised)."""

    model: str = ""
    prompt: str = ""
    options: Options | None = None
    keep_alive: float | str | None = None


class ShowRequest(Strict):
    model: str = ""
    name: str | None = None  # the older field
    verbose: StrictBool = False
    system: str | None = None
    template: str | None = None
    options: dict[str, Any] | None = None
