"""POST /v1/chat/completions' body: messages (text parts; media refused by name), tools and
tool choice (and the legacy functions), the chat template's options, and the peers' extras."""
from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field

from trillm.http import json_body
from trillm.http.protocol.common import MAX_LIST_ITEMS, MAX_TOOLS, Strict, TemplateOptions
from trillm.http.protocol.sampling import SamplingFields
from trillm.sampling_params import SamplingParamError, SamplingParams


class TextPart(Strict):
    type: Literal["text"]
    text: str


class MediaPart(Strict):
    """An image, audio or file part: valid OpenAI, refused by a text-only model with a message
    that says so (not a schema error listing the union's members)."""

    type: Literal["image_url", "input_audio", "file"]
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCallMessage(Strict):
    """A call an earlier assistant turn made, as the client sends the conversation back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[Annotated[TextPart | MediaPart, Field(discriminator="type")]],
                             Field(max_length=MAX_LIST_ITEMS)] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier answer's reasoning; templates drop it

    def for_template(self) -> dict:
        """A text-only model's template wants a string: text parts are joined. Tool calls go as
        the dicts templates that know tools expect (arguments decoded, as HF templates want)."""
        if isinstance(self.content, list):
            media = [p.type for p in self.content if isinstance(p, MediaPart)]
            if media:
                raise SamplingParamError(
                    "messages", f"This model takes text only; a message holds a {media[0]} part. Send text parts."
                )
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls
            ]
        return message


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class LegacyFunctionChoice(Strict):
    name: str


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_LIST_ITEMS)]  # LMDeploy's string: one user message (_one_string)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | NamedToolChoice | None = None  # "none" | "auto" | "required"; checked in http.tools
    parallel_tool_calls: bool | None = None
    # OpenAI's, honoured: metadata goes to the request's log line (as user does); reasoning_effort
    # to the chat template; functions / function_call are the legacy spelling of tools / tool_choice;
    # modalities must be text alone.
    metadata: dict[str, str] | None = Field(None, max_length=16)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    functions: list[FunctionDefinition] | None = Field(None, max_length=MAX_TOOLS)
    function_call: Literal["none", "auto"] | LegacyFunctionChoice | None = None
    modalities: list[Literal["text", "audio"]] | None = Field(None, max_length=MAX_LIST_ITEMS)
    # OpenAI's, accepted without effect here (README: why each).
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    # The peers' template extras and reasoning switches: vLLM's, then LMDeploy's, then SGLang's.
    chat_template: str | None = None  # only with --trust-request-chat-template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = Field(None, max_length=MAX_LIST_ITEMS)
    include_reasoning: bool = True  # false: the reasoning is dropped (vllm-router sends it on every request)
    do_preprocess: bool = True  # false: messages is the prompt, as it is (no template)
    enable_thinking: bool | None = None
    separate_reasoning: bool = True  # false: reasoning stays in content
    stream_reasoning: bool = True  # false: a stream sends the reasoning in one piece, once it ends

    def model_post_init(self, context) -> None:
        """The legacy functions become tools (and function_call the tool_choice), once, here; a
        request with both forms keeps them, for to_sampling_params to refuse by name (an error
        raised here would reach the client without its field)."""
        if (self.functions is not None or self.function_call is not None) and self.tools is None \
                and self.tool_choice is None:
            self.tools = [Tool(type="function", function=f) for f in self.functions or []] or None
            if isinstance(self.function_call, LegacyFunctionChoice):
                self.tool_choice = NamedToolChoice(type="function",
                                                   function=NamedFunction(name=self.function_call.name))
            else:
                self.tool_choice = self.function_call
            self.functions = self.function_call = None

    @pydantic.field_validator("messages", mode="before")
    @classmethod
    def _one_string(cls, value):
        """LMDeploy takes `messages` as a string: one user message (with do_preprocess false, the prompt)."""
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    def raw_prompt(self) -> str | None:
        """With do_preprocess false (LMDeploy's), the prompt text to use as it is: the one user
        message's (sent as a string); else None."""
        if self.do_preprocess:
            return None
        if len(self.messages) != 1 or self.messages[0].role != "user" or not isinstance(self.messages[0].content, str):
            raise SamplingParamError("do_preprocess", "do_preprocess false takes messages as one prompt string.")
        return self.messages[0].content

    def template_options(self, model_template: str | None, trust_request_template: bool) -> TemplateOptions:
        """How to render this request's messages. A template of the request's own is refused
        unless the server trusts them (--trust-request-chat-template, as vLLM's): a template is
        code the server runs."""
        if self.chat_template is not None and not trust_request_template:
            raise SamplingParamError("chat_template", "This server does not take chat templates in requests "
                                                      "(start it with --trust-request-chat-template).")
        if self.continue_final_message and self.add_generation_prompt:
            raise SamplingParamError("continue_final_message", "continue_final_message needs add_generation_prompt "
                                                               "false: the answer continues the last message.")
        if self.continue_final_message and self.messages and self.messages[-1].role != "assistant":
            raise SamplingParamError("continue_final_message", "continue_final_message needs the last message to "
                                                               "be the assistant's.")
        template = self.chat_template or model_template
        return TemplateOptions(self._template_kwargs(template), self.chat_template, self.add_generation_prompt,
                               self.continue_final_message, self.add_special_tokens, self.documents)

    def _template_kwargs(self, template: str | None) -> dict[str, Any] | None:
        """chat_template_kwargs, with reasoning_effort passed on as `reasoning_effort`, and as
        `enable_thinking` (off for "none" and "minimal") where the template reads that and the
        client did not set it; LMDeploy's top-level enable_thinking likewise."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.enable_thinking is not None:
            kwargs.setdefault("enable_thinking", self.enable_thinking)
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
            if "enable_thinking" in (template or ""):
                kwargs.setdefault("enable_thinking", self.reasoning_effort not in ("none", "minimal"))
        return kwargs or None

    def to_sampling_params(self, vocab_size: int, tokenizer) -> SamplingParams:
        if self.functions is not None or self.function_call is not None:
            raise SamplingParamError("functions", "Send tools and tool_choice, or the legacy functions and "
                                                  "function_call, not both.")
        if self.modalities is not None and "audio" in self.modalities:
            raise SamplingParamError("modalities", "This model outputs text only: modalities must be [\"text\"].")
        if self.top_logprobs is not None and not self.logprobs:
            raise SamplingParamError("top_logprobs", "top_logprobs needs logprobs to be true.")
        if self.output_limit == 0:
            raise SamplingParamError(self.output_limit_field, "max_tokens must be at least 1.")
        try:
            return self._sampling_params(vocab_size, tokenizer, self.output_limit,
                                         (self.top_logprobs or 0) if self.logprobs else None)
        except SamplingParamError as exc:
            raise SamplingParamError(self.field_names.get(exc.param, exc.param), str(exc), exc.status) from None

    @property
    def field_names(self) -> dict[str, str]:
        """The engine's and SamplingParams' names for what this client named differently, so
        that an error points at the field the client sent."""
        return {
            "prompt": "messages",
            "logprobs": "top_logprobs",
            "max_tokens": self.output_limit_field,
        }


def _json_or_text(text: str):
    """A tool call's arguments for the template: the object they spell, or the text itself when
    they are not JSON a server reads (json_body: not JSON, a key twice, nested too deep)."""
    try:
        return json_body.loads(text)
    except json_body.JSONError:
        return text
