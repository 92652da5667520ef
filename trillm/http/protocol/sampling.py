"""The sampling fields, declared once and translated into SamplingParams once.

Every API family spells the common knobs alike (SamplingParams' own names): SamplingKnobs holds
them, PenaltyKnobs adds the penalties and the seed that LMDeploy's flat /generate body lacks, and
SamplingFields is what OpenAI's chat and completions bodies add (with vLLM's, LMDeploy's,
TensorRT-LLM's and SGLang's extras). A field left out, or sent as null, takes SamplingParams'
default. Unknown fields are refused (OpenAI answers 400 to them too): a misspelt `max_token`
silently ignored would be worse than an error. Range checks are not repeated here: SamplingParams
owns them, and its SamplingParamError names the field.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, StrictBool, StrictInt

from trillm.http.protocol.common import (
    MAX_CHOICES,
    MAX_LIST_ITEMS,
    MAX_N,
    LoRARequest,
    StreamOptions,
    Strict,
    TokenIds,
    session_name,
)
from trillm.http.protocol.structured import (
    ResponseFormat,
    StructuredOutputs,
    choice_spec,
    schema_spec,
    structural_tag_spec,
)
from trillm.sampling_params import SamplingParamError, SamplingParams, StructuredOutput


class SamplingKnobs(Strict):
    """The knobs every API family names alike."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_LIST_ITEMS)] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool | None = False
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True

    def knobs(self) -> dict[str, Any]:
        """These fields as SamplingParams' keyword arguments, null and absent alike its defaults."""
        return dict(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=self.skip_special_tokens is not False,
            spaces_between_special_tokens=self.spaces_between_special_tokens is not False,
        )


class PenaltyKnobs(SamplingKnobs):
    """The common knobs, and the penalties and seed of OpenAI's bodies and SGLang's."""

    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None

    def knobs(self) -> dict[str, Any]:
        return dict(super().knobs(), frequency_penalty=self.frequency_penalty or 0.0,
                    presence_penalty=self.presence_penalty or 0.0, seed=self.seed)


class SamplingFields(PenaltyKnobs):
    """What chat and completions requests share, beside the knobs."""

    model: str | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = Field(None, fail_fast=True)  # a vocabulary's worth: no bound on count
    user: str | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None  # chat's name, accepted by completions too; it wins
    # vLLM / LMDeploy extras
    min_tokens: int = 0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's; and its older guided_* fields:
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    guided_grammar: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs, with this many top ones
    cache_salt: str | None = None  # vLLM's and TensorRT-LLM's: prefix-cache isolation between tenants
    priority: int = Field(0, ge=-(2**31), lt=2**31)  # vLLM's: lower runs first (--scheduling-policy priority)
    allowed_token_ids: TokenIds | None = None  # vLLM's: only these may be sampled
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
    def output_limit(self) -> int | None:
        """The most tokens to generate: max_completion_tokens if sent, else max_tokens."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    @property
    def output_limit_field(self) -> str:
        """The field `output_limit` came from, for an error to name."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

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
        knobs = self.knobs()
        knobs["top_p"] = max(knobs["top_p"], self.top_p_min)
        knobs["include_stop_str_in_output"] |= self.no_stop_trim
        return SamplingParams(
            **knobs,
            n=self.n,
            logit_bias=_token_biases(self.logit_bias, vocab_size),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens if self.min_new_tokens is None else self.min_new_tokens,
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
                specs.append(schema_spec(so.json_, f"{param}.json"))
            if so.regex is not None:
                specs.append(StructuredOutput("regex", so.regex, param=f"{param}.regex"))
            if so.choice is not None:
                specs.append(choice_spec(so.choice, f"{param}.choice"))
            if so.grammar is not None:
                specs.append(StructuredOutput("grammar", so.grammar, param=f"{param}.grammar"))
            if so.json_object:
                specs.append(StructuredOutput("json_object", param=f"{param}.json_object"))
            if so.structural_tag is not None:
                specs.append(structural_tag_spec(so.structural_tag, f"{param}.structural_tag"))
        if self.guided_json is not None:
            specs.append(schema_spec(self.guided_json, "guided_json"))
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
