"""Turning one request's stream of StepOutputs into text, tokens and a finish reason.

The offline API and the server both consume the engine through this class, so a
stop string, a stop token's text or a held-back half character is handled the
same way in both. It runs on the caller's side (the Trio side in the server),
never inside EngineCore.step().
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trillm.engine.core import StepOutput
from trillm.engine.detokenizer import IncrementalDetokenizer
from trillm.engine.sampler import TokenLogprobs
from trillm.pooling_params import PoolingParams
from trillm.sampling_params import SamplingParams
from trillm.sched_ext import FinishReason


@dataclass
class Delta:
    """What is new for the client since the last delta."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # in the delta where they arrived
    pooled: torch.Tensor | None = None  # a pooling request's vector, in its final delta


@dataclass
class Completion:
    """Everything a request produced, accumulated from its deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # when asked: from prompt_logprobs_start on
    pooled: torch.Tensor | None = None  # a pooling request's vector (fp32, raw)


class TokenIdsOnly:
    """The detokenizer of a model without a tokenizer (a test or benchmark model made from a
    bare config): the request streams token ids, its text stays "", and stop strings, which
    need text, are refused up front."""

    stopped = False
    stop_reason = None
    num_tokens_read = 0  # never stops, so never needs the count

    def __init__(self, params: SamplingParams):
        if params.stop:
            raise ValueError("Stop strings need a tokenizer, and this model has none.")

    def add(self, new_token_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


class OutputProcessor:
    """Per-request: detokenizes incrementally and decides when a stop string ends it.

    When `process` returns a finished delta whose StepOutput was not finished, the
    request was ended by a stop string: the caller must abort it in the engine
    (reason "stop") so that its blocks are freed.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams, index: int = 0):
        self.params = params
        if tokenizer is None:
            self.detokenizer = TokenIdsOnly(params)
        else:
            self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        self.completion = Completion(index=index, logprobs=[] if params.logprobs is not None else None)

    @property
    def finished(self) -> bool:
        return self.completion.finish_reason is not None

    def process(self, out: StepOutput) -> Delta:
        assert not self.finished, "a finished request got more output"
        c = self.completion
        c.num_prompt_tokens, c.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
        tokens = list(out.new_token_ids)
        text_tokens = tokens
        if out.stop_token_id != -1 and tokens and not self.params.include_stop_str_in_output:
            text_tokens = tokens[:-1]  # the EOS / stop token that ended it is not text
        read_before = self.detokenizer.num_tokens_read
        text = self.detokenizer.add(text_tokens)
        finish_reason, stop_reason = out.finish_reason, None
        if self.detokenizer.stopped:
            finish_reason, stop_reason = FinishReason.STOP, self.detokenizer.stop_reason
            # A step may bring several tokens (a verified run of drafts): none after the stop string's.
            tokens = tokens[:self.detokenizer.num_tokens_read - read_before]
        elif out.finished:
            text += self.detokenizer.flush()
            if out.stop_token_id != -1 and out.stop_token_id in self.params.stop_token_ids:
                stop_reason = out.stop_token_id
        logprobs = None
        if c.logprobs is not None:
            logprobs = list(out.new_logprobs or [])[:len(tokens)]
            c.logprobs.extend(logprobs)
        c.text += text
        c.token_ids.extend(tokens)
        c.finish_reason, c.stop_reason = finish_reason, stop_reason
        if out.prompt_logprobs is not None:
            c.prompt_logprobs = out.prompt_logprobs
        return Delta(text, tokens, logprobs, finish_reason is not None, finish_reason, stop_reason, out.prompt_logprobs)


class PoolingProcessor:
    """Per pooling request, what OutputProcessor is per generating one: its one final output
    carries the pooled vector; there is no text."""

    def __init__(self, index: int = 0):
        self.completion = Completion(index=index)

    @property
    def finished(self) -> bool:
        return self.completion.finish_reason is not None

    def process(self, out: StepOutput) -> Delta:
        assert not self.finished and out.finished, "a pooling request has one output, its last"
        c = self.completion
        c.num_prompt_tokens, c.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
        c.finish_reason, c.pooled = out.finish_reason, out.pooled
        return Delta("", [], None, True, out.finish_reason, pooled=out.pooled)


def output_processor(tokenizer, prompt_token_ids: list[int], params: SamplingParams | PoolingParams, index: int = 0):
    """The processor for a request of these params: OutputProcessor or PoolingProcessor."""
    if isinstance(params, PoolingParams):
        return PoolingProcessor(index)
    return OutputProcessor(tokenizer, prompt_token_ids, params, index)
