"""Request bodies, as pydantic models, and their translation into SamplingParams.

Unknown fields are rejected (OpenAI answers 400 to them too): a misspelt
`max_token` silently ignored would be worse than an error. Besides OpenAI's own
fields, the sampling extras vLLM and LMDeploy accept are here, with their names.
Range checks are not repeated here: SamplingParams owns them, and its
SamplingParamError names the field.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from trillm.http import json_body
from trillm.sampling_params import SamplingParamError, SamplingParams, StructuredOutput

MAX_N = 128  # samples per request: more would let one request fill the whole batch
MAX_PROMPTS = 2048  # prompts in one request's list (OpenAI's bound for a batch of inputs)
# Bounds on a request's other lists, each refused by its length before any item is read: a
# list's cost (validation, template rendering, a grammar compile, the sampler's masks) grows
# with it, and the body limit alone lets through millions of short items.
MAX_LIST_ITEMS = 10_000  # chat messages, Responses input items, bad_words
MAX_TOOLS = 1024  # tools (OpenAI allows 128)
MAX_CHOICES = 1024  # guided_choice / structured_outputs.choice alternatives (one regex; its compile grows with them)


@dataclass(frozen=True)
class TemplateOptions:
    """How chat messages become a prompt (trillm.http.prompts.chat_prompt): the chat template's
    extra variables, the template itself (None: the model's), and the peers' switches."""

    kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is left open, to be continued
    add_special_tokens: bool = False  # the template already holds any BOS
    documents: list[dict[str, Any]] | None = None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JSONSchemaFormat(Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TagStructure(Strict):
    """One tagged region of the older structural-tag form: `begin`, JSON after `schema`, `end`."""

    begin: str
    schema_: dict[str, Any] = Field(alias="schema")
    end: str


class ResponseFormat(Strict):
    """OpenAI's text / json_object / json_schema, and the peers' extensions: `regex` and `ebnf`
    (vLLM, SGLang), `json` with `schema` (TensorRT-LLM), `regex_schema` (LMDeploy), and
    `structural_tag`, as xgrammar's `format` (TensorRT-LLM, vLLM) or the older `structures` with
    `triggers` (vLLM, SGLang)."""

    type: Literal["text", "json_object", "json_schema", "json", "regex", "regex_schema", "ebnf", "structural_tag"]
    json_schema: JSONSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    regex: str | None = None
    regex_schema: str | None = None
    ebnf: str | None = None
    format: dict[str, Any] | None = None
    structures: list[TagStructure] | None = None
    triggers: list[str] | None = None

    def to_structured_output(self, param: str = "response_format") -> StructuredOutput | None:
        """None for plain text. A schema is strict (no property it does not name) unless
        `strict` is false: a small model left free to add properties tends to."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object", param=param)
        if self.type == "structural_tag":
            return self._structural_tag(param)
        field_name = {"json": "schema", "json_schema": "json_schema"}.get(self.type, self.type)
        value = {"json": self.schema_, "json_schema": self.json_schema, "regex": self.regex,
                 "regex_schema": self.regex_schema, "ebnf": self.ebnf}[self.type]
        if not value:
            raise SamplingParamError(
                f"{param}.{field_name}", f"A response_format of type {self.type} needs a non-empty {field_name}."
            )
        if self.type == "json":
            return StructuredOutput.from_schema(value, param=param)
        if self.type == "json_schema":
            return StructuredOutput.from_schema(value.schema_ or {}, strict=value.strict is not False, param=param)
        return StructuredOutput("grammar" if self.type == "ebnf" else "regex", value, param=param)

    def _structural_tag(self, param: str) -> StructuredOutput:
        if self.format is not None:
            tag = {"type": "structural_tag", "format": self.format}
        elif self.structures and self.triggers:
            tag = {"structures": [s.model_dump(by_alias=True) for s in self.structures], "triggers": self.triggers}
        else:
            raise SamplingParamError(param, "A structural_tag needs a format, or structures and triggers.")
        return StructuredOutput("structural_tag", json.dumps(tag), param=param)


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one of these. `structural_tag` is a response_format of
    type structural_tag, as JSON text."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


def choice_spec(choices: list[str], param: str) -> StructuredOutput:
    """The output is one of `choices`, exactly: a regex of their literal alternatives."""
    return StructuredOutput("regex", "|".join(f"({re.escape(c)})" for c in choices), param=param)


def _schema_spec(value: str | dict, param: str) -> StructuredOutput:
    """A JSON schema sent as an object or as JSON text (vLLM takes both)."""
    if isinstance(value, str):
        try:
            value = json_body.loads(value)
        except json_body.JSONError as exc:
            raise SamplingParamError(param, f"{param} cannot be read: {exc}") from None
    if not isinstance(value, dict):
        raise SamplingParamError(param, f"{param} must be a JSON schema object.")
    return StructuredOutput.from_schema(value, param=param)


def _structural_tag_spec(text: str, param: str) -> StructuredOutput:
    try:
        tag = ResponseFormat.model_validate_json(text)
    except pydantic.ValidationError as exc:
        raise SamplingParamError(param, f"{param} is not a valid structural tag: {exc.errors()[0]['msg']}") from None
    if tag.type != "structural_tag":
        raise SamplingParamError(param, f"{param} must have type structural_tag.")
    return tag.to_structured_output(param)


class LoRARequest(Strict):
    """TensorRT-LLM's `lora_request`: the adapter to run under, by name; an adapter not loaded yet
    is loaded from `lora_path` first. `lora_int_id` is the client's number for it (trillm numbers
    adapters itself, so it is not used)."""

    lora_name: str
    lora_int_id: int | None = None
    lora_path: str | None = None


class LoadLoRAAdapterRequest(Strict):
    """vLLM's /v1/load_lora_adapter body; `load_inplace` replaces an adapter of the same name."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(Strict):
    """vLLM's /v1/unload_lora_adapter body (`lora_int_id` is taken and not used: names are unique)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class UpdateWeightsRequest(Strict):
    """SGLang's update_weights_from_disk body, with trillm's `abort_running` beside SGLang's
    `abort_all_requests` (either aborts running requests instead of waiting for them)."""

    model_path: str = Field(min_length=1)
    load_format: Literal["auto"] | None = None
    abort_running: bool = False
    abort_all_requests: bool = False


class SamplingFields(Strict):
    """What chat and completions requests share."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM / LMDeploy extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's; and its older guided_* fields:
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    guided_grammar: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs, with this many top ones
    cache_salt: str | None = None  # vLLM's and TensorRT-LLM's: prefix-cache isolation between tenants
    priority: int = Field(0, ge=-(2**31), lt=2**31)  # vLLM's: lower runs first (--scheduling-policy priority)
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    bad_words: list[str] | None = Field(None, max_length=MAX_LIST_ITEMS)  # vLLM's: words the output must not contain
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM's, TensorRT-LLM's: keep the last k (-1: the context)
    return_token_ids: bool = False  # vLLM's, LMDeploy's: prompt and output token ids in the response
    top_p_min: float = Field(0.0, ge=0, le=1)  # TensorRT-LLM's floor of top_p (it has no decay here)
    min_new_tokens: int | None = None  # LMDeploy's name for min_tokens
    session_id: int | None = None  # LMDeploy's: the client's name for the request (/abort_request takes it)
    # SGLang's, which sglang-router writes into every request it forwards: no_stop_trim keeps a
    # matched stop string in the output; hidden states are not offered (true is refused).
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    lora_request: LoRARequest | None = None  # TensorRT-LLM's: the LoRA adapter (or the model field names one)

    @property
    def session_name(self) -> str | None:
        """The session id as a client id (LMDeploy's -1: none)."""
        return session_name(self.session_id)

    def _sampling_params(
        self, vocab_size: int, tokenizer, max_tokens: int | None, logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise SamplingParamError("stream_options", "stream_options is only allowed when stream is true.")
        if self.return_hidden_states:
            raise SamplingParamError("return_hidden_states", "This server does not return hidden states.")
        if self.truncate_prompt_tokens == 0:
            raise SamplingParamError("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 or at least 1.")
        bad_ids = [t for t in self.allowed_token_ids or [] if not 0 <= t < vocab_size]
        if bad_ids:
            raise SamplingParamError("allowed_token_ids", f"Token ids must be in [0, {vocab_size}); got {bad_ids[0]}.")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=max(1.0 if self.top_p is None else self.top_p, self.top_p_min),
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            logit_bias=_token_biases(self.logit_bias, vocab_size),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens if self.min_new_tokens is None else self.min_new_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            cache_salt=self.cache_salt,
            priority=self.priority,
            structured_output=self.structured_output(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words_token_ids=_bad_words_token_ids(tokenizer, self.bad_words),
        )

    def truncated(self, prompt: list[int], max_model_len: int) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (-1: the model's context length), or all of it."""
        keep = max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        return prompt if keep is None else prompt[-keep:]

    def structured_output(self) -> StructuredOutput | None:
        """The one grammar the request names, by whichever spelling: response_format, vLLM's
        structured_outputs, or its guided_* fields. Two at once is a 400 naming the second."""
        specs = []
        if self.response_format is not None and self.response_format.type != "text":
            specs.append(self.response_format.to_structured_output())
        so = self.structured_outputs
        if so is not None:
            param = "structured_outputs"
            if so.json_ is not None:
                specs.append(_schema_spec(so.json_, f"{param}.json"))
            if so.regex is not None:
                specs.append(StructuredOutput("regex", so.regex, param=f"{param}.regex"))
            if so.choice is not None:
                specs.append(choice_spec(so.choice, f"{param}.choice"))
            if so.grammar is not None:
                specs.append(StructuredOutput("grammar", so.grammar, param=f"{param}.grammar"))
            if so.json_object:
                specs.append(StructuredOutput("json_object", param=f"{param}.json_object"))
            if so.structural_tag is not None:
                specs.append(_structural_tag_spec(so.structural_tag, f"{param}.structural_tag"))
        if self.guided_json is not None:
            specs.append(_schema_spec(self.guided_json, "guided_json"))
        if self.guided_regex is not None:
            specs.append(StructuredOutput("regex", self.guided_regex, param="guided_regex"))
        if self.guided_choice is not None:
            specs.append(choice_spec(self.guided_choice, "guided_choice"))
        if self.guided_grammar is not None:
            specs.append(StructuredOutput("grammar", self.guided_grammar, param="guided_grammar"))
        if len(specs) > 1:
            raise SamplingParamError(specs[1].param, f"{specs[1].param} cannot be combined with {specs[0].param}: "
                                                     "send one structured-output spec.")
        return specs[0] if specs else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


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
    content: str | list[Annotated[TextPart | MediaPart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
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
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | NamedToolChoice | None = None  # "none" | "auto" | "required"; checked in http.tools
    parallel_tool_calls: bool | None = None
    # OpenAI's, honoured: metadata goes to the request's log line (as user does); reasoning_effort
    # to the chat template; functions / function_call are the legacy spelling of tools / tool_choice;
    # modalities must be text alone.
    metadata: dict[str, str] | None = Field(None, max_length=16)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | LegacyFunctionChoice | None = None
    modalities: list[Literal["text", "audio"]] | None = None
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
    # The peers' template extras: vLLM's, then LMDeploy's, then SGLang's reasoning switches.
    chat_template: str | None = None  # only with --trust-request-chat-template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
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
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens == 0:
            raise SamplingParamError(self.field_names["max_tokens"], "max_tokens must be at least 1.")
        try:
            return self._sampling_params(vocab_size, tokenizer, max_tokens,
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
            "max_tokens": "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens",
        }


def _prompt_count(value):
    """A list that is not one prompt's token ids is refused by its length before any item is
    validated: each item of a long list would otherwise fail every member of the union in
    turn, and a body of a million strings would build millions of errors."""
    if isinstance(value, list) and len(value) > MAX_PROMPTS and not all(type(v) is int for v in value):
        raise ValueError(f"A request holds at most {MAX_PROMPTS} prompts; this list holds {len(value)}.")
    return value


PromptList = Annotated[list[str], Field(max_length=MAX_PROMPTS)]
TokenPromptList = Annotated[list[list[int]], Field(max_length=MAX_PROMPTS)]
Prompt = Annotated[str | PromptList | list[int] | TokenPromptList, pydantic.BeforeValidator(_prompt_count)]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    max_completion_tokens: int | None = None  # chat's name, accepted here too (wins over max_tokens)
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # only = n: more samples than returned is not done here
    suffix: None = None  # no fill-in-the-middle: a suffix is refused rather than ignored

    def model_post_init(self, context) -> None:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens

    def to_sampling_params(self, vocab_size: int, tokenizer) -> SamplingParams:
        """echo with logprobs k reports the prompt's tokens too, with k top logprobs each (the
        engine's prompt_logprobs, unless the request sets its own). max_tokens 0 is the prompt
        alone, which only echo or prompt_logprobs makes worth asking."""
        if self.best_of is not None and self.best_of != self.n:
            raise SamplingParamError("best_of", f"best_of must equal n ({self.n}) here: trillm returns every sample it draws.")
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise SamplingParamError(
                "max_tokens", "max_tokens 0 returns nothing without echo or prompt_logprobs; ask for at least 1."
            )
        prompt_logprobs = self.logprobs if self.echo and self.prompt_logprobs is None else None
        return self._sampling_params(vocab_size, tokenizer, self.max_tokens, self.logprobs, prompt_logprobs)

    @property
    def echo_logprobs(self) -> bool:
        """The echoed prompt carries logprobs (OpenAI's echo with logprobs)."""
        return bool(self.echo) and self.logprobs is not None


class EmbeddingRequest(Strict):
    """OpenAI's embeddings body (also /pooling's, as vLLM's)."""

    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # keep the first `dimensions`, then renormalise
    user: str | None = None


TextList = Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]


class ScoreRequest(Strict):
    """vLLM's /score: text_1 against each text_2 (one against many), or pair by pair (equal lists)."""

    model: str | None = None
    text_1: str | TextList
    text_2: str | TextList
    user: str | None = None


class RerankRequest(Strict):
    """The Jina / Cohere rerank body, as vLLM serves it at /rerank, /v1/rerank and /v2/rerank."""

    model: str | None = None
    query: str
    documents: TextList
    top_n: int | None = Field(None, ge=0)  # None or 0: every document
    return_documents: bool = True
    user: str | None = None


class NativeSamplingParams(Strict):
    """/generate's sampling_params: SamplingParams' names, with SGLang's max_new_tokens / min_new_tokens."""

    max_new_tokens: int | None = 128  # 0: the prompt alone (for its logprobs)
    min_new_tokens: int = 0
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


class GenerateRequest(Strict):
    """SGLang's /generate body: one prompt or a batch; a batch may name each prompt (`rid`) and
    give each its own `sampling_params` (lists as long as the batch)."""

    text: str | PromptList | None = None
    input_ids: Annotated[list[int] | TokenPromptList | None, pydantic.BeforeValidator(_prompt_count)] = None
    sampling_params: NativeSamplingParams | Annotated[list[NativeSamplingParams], Field(min_length=1)] = Field(
        default_factory=NativeSamplingParams)
    stream: bool = False
    rid: str | Annotated[list[str], Field(min_length=1)] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = Field(-1, ge=-1)  # SGLang's: -1, the output's logprobs only
    lora_path: str | None | Annotated[list[str | None], Field(min_length=1)] = None  # SGLang's: an adapter's name, or one per prompt

    def to_sampling_params(self, num_prompts: int) -> SamplingParams | list[SamplingParams]:
        """The batch's settings, or one per prompt; the rid and sampling_params lists checked
        against the batch's size."""
        for name, value in (("rid", self.rid), ("sampling_params", self.sampling_params)):
            if isinstance(value, list) and len(value) != num_prompts:
                raise SamplingParamError(name, f"{name} lists {len(value)} entries for {num_prompts} prompts.")
        if not isinstance(self.sampling_params, list):
            return self._params(self.sampling_params)
        params = [self._params(p) for p in self.sampling_params]
        if len({p.n for p in params}) > 1:
            raise SamplingParamError("sampling_params", "Every prompt's sampling_params must have the same n.")
        return params

    def _params(self, p: NativeSamplingParams) -> SamplingParams:
        fields = p.model_dump(exclude={"max_new_tokens", "min_new_tokens", "stop", "stop_token_ids"})
        return SamplingParams(
            **fields,
            max_tokens=p.max_new_tokens,
            min_tokens=p.min_new_tokens,
            stop=[p.stop] if isinstance(p.stop, str) else list(p.stop or []),
            stop_token_ids=list(p.stop_token_ids or []),
            logprobs=self.top_logprobs_num if self.return_logprob else None,
            prompt_logprobs=self.top_logprobs_num if self.input_logprobs else None,
            prompt_logprobs_start=max(self.logprob_start_len, 0),
        )

    @property
    def input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0


class LMDeployGenerateRequest(Strict):
    """LMDeploy's /generate body: flat, its sampling fields at the top level, named by
    `session_id`. It becomes SGLang's form (`to_native`), so both run the same way."""

    prompt: str | None = None
    input_ids: list[int] | None = None
    session_id: int | None = -1
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = 1.0
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = False
    return_logprob: bool | None = None
    image_data: None = None  # a text-only model: images are refused, not ignored
    mm_processor_kwargs: dict[str, Any] | None = None  # no multimodal processor here: nothing to pass them to
    return_routed_experts: Literal[False] = False  # a dense model routes no experts

    def to_native(self) -> GenerateRequest:
        sampling = NativeSamplingParams(
            max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            ignore_eos=bool(self.ignore_eos), skip_special_tokens=self.skip_special_tokens is not False,
            spaces_between_special_tokens=self.spaces_between_special_tokens is not False,
            include_stop_str_in_output=bool(self.include_stop_str_in_output), stop=self.stop,
            stop_token_ids=self.stop_token_ids,
        )
        return GenerateRequest(text=self.prompt, input_ids=self.input_ids, sampling_params=sampling,
                               stream=bool(self.stream), rid=session_name(self.session_id),
                               return_logprob=bool(self.return_logprob))


def session_name(session_id: int | None) -> str | None:
    """LMDeploy's session id as a client id (-1: none)."""
    return None if session_id is None or session_id == -1 else str(session_id)


class AbortRequest(Strict):
    """SGLang's and LMDeploy's: `rid` or `session_id` names what to abort, or `abort_all`;
    `finished_reason` (an object) or `abort_message` becomes the aborted requests' /generate
    finish_reason."""

    rid: str | None = None
    session_id: int | None = -1
    abort_all: bool = False
    abort_message: str | None = None
    finished_reason: dict[str, Any] | None = None

    @property
    def name(self) -> str | None:
        return self.rid if self.rid is not None else session_name(self.session_id)

    @property
    def note(self) -> dict | None:
        if self.finished_reason is not None:
            return self.finished_reason
        return None if self.abort_message is None else {"type": "abort", "message": self.abort_message}


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_LIST_ITEMS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)  # rendered as chat renders them (vLLM's)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def template_options(self) -> TemplateOptions:
        return TemplateOptions(self.chat_template_kwargs, None, self.add_generation_prompt,
                               self.continue_final_message, bool(self.add_special_tokens))


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


def _json_or_text(text: str):
    """A tool call's arguments for the template: the object they spell, or the text itself when
    they are not JSON a server reads (json_body: not JSON, a key twice, nested too deep)."""
    try:
        return json_body.loads(text)
    except json_body.JSONError:
        return text


def _bad_words_token_ids(tokenizer, words: list[str] | None) -> list[list[int]] | None:
    """Each bad word's tokens as it would start the output and as it would follow a space (a
    BPE vocabulary spells the two differently), as vLLM reads bad_words."""
    if not words:
        return None
    if tokenizer is None:
        raise SamplingParamError("bad_words", "bad_words needs text, and this model has no tokenizer.")
    sequences: dict[tuple[int, ...], None] = {}  # in order, each once
    for word in words:
        if not word.strip():
            raise SamplingParamError("bad_words", "bad_words must not hold an empty word.")
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids:
                sequences[tuple(ids)] = None
    return [list(ids) for ids in sequences] or None


def _token_biases(logit_bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not logit_bias:
        return None
    biases = {}
    for key, bias in logit_bias.items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
            raise SamplingParamError(
                "logit_bias", f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}."
            )
        biases[int(key)] = bias
    return biases
