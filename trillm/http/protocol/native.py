"""The native routes' bodies: SGLang's and LMDeploy's /generate, /abort_request, /tokenize and
/detokenize."""
from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field

from trillm.http.protocol.chat import ChatMessage, Tool
from trillm.http.protocol.common import (
    MAX_LIST_ITEMS,
    MAX_N,
    MAX_PROMPTS,
    MAX_TOOLS,
    PromptList,
    Strict,
    TemplateOptions,
    TokenIds,
    TokenPromptList,
    bounded_prompts,
    session_name,
)
from trillm.http.protocol.sampling import PenaltyKnobs, SamplingKnobs
from trillm.sampling_params import SamplingParamError, SamplingParams


class NativeSamplingParams(PenaltyKnobs):
    """/generate's sampling_params: the knobs, with SGLang's max_new_tokens / min_new_tokens."""

    max_new_tokens: int | None = 128  # 0: the prompt alone (for its logprobs)
    min_new_tokens: int = 0
    n: int = Field(1, ge=1, le=MAX_N)


class GenerateRequest(Strict):
    """SGLang's /generate body: one prompt or a batch; a batch may name each prompt (`rid`) and
    give each its own `sampling_params` (lists as long as the batch)."""

    text: str | PromptList | None = None
    input_ids: Annotated[TokenIds | TokenPromptList | None, pydantic.BeforeValidator(bounded_prompts)] = None
    sampling_params: NativeSamplingParams | Annotated[list[NativeSamplingParams],
                                                      Field(min_length=1, max_length=MAX_PROMPTS)] = Field(
        default_factory=NativeSamplingParams)
    stream: bool = False
    rid: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = Field(-1, ge=-1)  # SGLang's: -1, the output's logprobs only
    # SGLang's: an adapter's name, or one per prompt
    lora_path: str | None | Annotated[list[str | None], Field(min_length=1, max_length=MAX_PROMPTS)] = None

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
        return SamplingParams(
            **p.knobs(),
            n=p.n,
            max_tokens=p.max_new_tokens,
            min_tokens=p.min_new_tokens,
            logprobs=self.top_logprobs_num if self.return_logprob else None,
            prompt_logprobs=self.top_logprobs_num if self.input_logprobs else None,
            prompt_logprobs_start=max(self.logprob_start_len, 0),
        )

    @property
    def input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0


class LMDeployGenerateRequest(SamplingKnobs):
    """LMDeploy's /generate body: flat, its sampling fields at the top level, named by
    `session_id`. It becomes SGLang's form (`to_native`), so both run the same way."""

    prompt: str | None = None
    input_ids: TokenIds | None = None
    session_id: int | None = -1
    max_tokens: int = 128
    stream: bool | None = False
    return_logprob: bool | None = None
    image_data: None = None  # a text-only model: images are refused, not ignored
    mm_processor_kwargs: dict[str, Any] | None = None  # no multimodal processor here: nothing to pass them to
    return_routed_experts: Literal[False] = False  # a dense model routes no experts

    def to_native(self) -> GenerateRequest:
        knobs = self.model_dump(include=set(SamplingKnobs.model_fields))
        sampling = NativeSamplingParams(**knobs, max_new_tokens=self.max_tokens)
        return GenerateRequest(text=self.prompt, input_ids=self.input_ids, sampling_params=sampling,
                               stream=bool(self.stream), rid=session_name(self.session_id),
                               return_logprob=bool(self.return_logprob))


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
    tokens: TokenIds
