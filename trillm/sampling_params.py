"""How one request is sampled and when it stops.

Validation lives here, not in the HTTP layer, so that the offline API and the
server refuse the same things with the same words. Every error is a
`ValueError` whose `param` attribute names the offending field; the server turns
it into a 400 with that `param`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Literal

_GREEDY_EPS = 1e-5
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
# torch.Generator.manual_seed takes a signed or unsigned 64-bit value; beyond that it raises.
SEED_RANGE = (-(2**63), 2**64)
MAX_LOGPROBS = 20  # top logprobs per token, OpenAI's bound


class SamplingParamError(ValueError):
    """A sampling parameter is out of range; `param` names it. `status`: the server's answer
    (400; 404 when what the parameter names does not exist, as an unknown LoRA adapter)."""

    def __init__(self, param: str, message: str, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status

    def __reduce__(self):  # pickled across the engine's process boundary, with its fields
        return type(self), (self.param, str(self), self.status)


Kind = Literal["json_schema", "json_object", "regex", "grammar", "structural_tag"]


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. `spec`: the schema as JSON text, the pattern, the EBNF
    grammar, or the structural tag as JSON text (xgrammar's `{"type": "structural_tag", "format":
    ...}`, or the older `{"structures": [...], "triggers": [...]}`); "" for json_object.
    `strict`: a JSON schema allows no property it does not name."""

    kind: Kind
    spec: str = ""
    strict: bool = True
    # The request field the spec came from, so that a bad spec's error names it; not part of
    # the spec's identity (equal grammars share one compiled cache entry).
    param: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        assert self.kind in ("json_schema", "json_object", "regex", "grammar", "structural_tag"), self.kind
        assert self.kind != "json_object" or self.spec == "", "json_object has no spec"
        if self.kind != "json_object" and not self.spec:
            raise SamplingParamError(self.param, f"{self.param} must not be empty.")

    @classmethod
    def from_schema(cls, schema: dict, strict: bool = True, param: str = "response_format") -> StructuredOutput:
        """A json_schema spec from a schema object (kept in its key order: the output follows it)."""
        return cls("json_schema", json.dumps(schema), strict, param)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length; 0: the prompt alone
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus the top k
    # The prompt tokens' logprobs, as `logprobs` (None: none), from position prompt_logprobs_start
    # on; position 0 has nothing before it, so its entry is None.
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    cache_salt: str | None = None  # requests share prefix-cached blocks only under the same salt
    priority: int = 0  # under the priority scheduling policy, lower runs first (vLLM's)
    lora_name: str | None = None  # the LoRA adapter to run under (None: the base model)
    structured_output: StructuredOutput | None = None  # a grammar the output must match
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's)
    # Token sequences the output must not form (vLLM's bad_words, tokenized): the last token of
    # each is forbidden wherever the output ends with the ones before it.
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        def bad(param: str, message: str) -> None:
            raise SamplingParamError(param, message)

        for name in _FLOAT_FIELDS:  # JSON parsers accept NaN and Infinity; no range check catches NaN
            if not math.isfinite(getattr(self, name)):
                bad(name, f"{name} must be a finite number, got {getattr(self, name)}.")
        if self.n < 1:
            bad("n", f"n must be at least 1, got {self.n}.")
        if self.temperature < 0:
            bad("temperature", f"temperature must be non-negative, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            bad("top_k", f"top_k must be -1 (off) or at least 1, got {self.top_k}.")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"repetition_penalty must be positive, got {self.repetition_penalty}.")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 0:
            bad("max_tokens", f"max_tokens must be non-negative, got {self.max_tokens}.")
        if self.min_tokens < 0:
            bad("min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                bad(name, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}.")
        if self.cache_salt is not None and not self.cache_salt.strip():
            bad("cache_salt", "cache_salt must be a non-empty string when given.")
        if self.prompt_logprobs_start < 0:
            bad("prompt_logprobs_start", f"prompt_logprobs_start must be non-negative, got {self.prompt_logprobs_start}.")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            bad("seed", f"seed must be a 64-bit integer, got {self.seed}.")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            bad("allowed_token_ids", "allowed_token_ids must hold at least one token id.")
        if any(not word for word in self.bad_words_token_ids or []):
            bad("bad_words", "bad_words must not hold an empty word.")
        for token_id, bias in (self.logit_bias or {}).items():
            if not -100 <= bias <= 100:
                bad("logit_bias", f"logit_bias for token {token_id} must be in [-100, 100], got {bias}.")

    @property
    def prefix_hit_limit(self) -> int:
        """Prompt tokens the prefix cache may serve (-1: any). A prompt logprob at position p
        comes from the hidden state at p - 1, which a cached block does not have."""
        if self.prompt_logprobs is None:
            return -1
        return max(self.prompt_logprobs_start - 1, 0)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def stop_token_set(self, eos_token_ids) -> frozenset[int]:
        """The tokens that end the request once `min_tokens` outputs precede them, and that the
        sampler forbids until then: `stop_token_ids`, and every one of the model's EOS ids (Llama
        3 has several) unless `ignore_eos`. Built once per request; the scheduler's finish check
        and the sampler's mask both read this one set, so they never disagree."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))
