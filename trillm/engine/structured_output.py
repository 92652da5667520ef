"""Structured output: a grammar that a request's tokens must follow, enforced while sampling.

A request names its grammar with a `StructuredOutput` spec on its SamplingParams (a JSON
schema, any JSON object, a regular expression, an EBNF grammar, or a structural tag: free
text in which each trigger starts a tagged region whose content is constrained). `Grammars` compiles a
spec against the engine's tokenizer with xgrammar and keeps one `GrammarMatcher` per
constrained engine request (so each of n samples has its own state). In a step, the
matchers of the constrained rows write their allowed tokens into a bitmask, the bitmask
sets every other token's logit to -inf in those rows only, and after sampling each matcher
advances by its row's token. A step with no constrained row does none of this.

Why compile off the engine: a schema compiles in milliseconds to seconds, and the engine's
step must not wait on it. The server compiles in a worker thread before admission
(`compile`, which also turns a bad spec into a SamplingParamError); admission then finds
the compiled grammar in a small LRU keyed by the spec. The tokenizer's xgrammar view, which
takes most of a second to build, is made once per engine, on first use.

A matcher's state depends only on the request's output tokens, which a preempted request
keeps, so preemption needs nothing here. When a grammar is complete, only the stop tokens
(the engine's EOS ids) are allowed; the scheduler then finishes the request as on any EOS.
xgrammar is imported on first use: the import takes seconds, and most engines never
constrain a request.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import torch

from trillm.sampling_params import SamplingParamError, StructuredOutput

CACHE_SIZE = 64  # compiled grammars kept; one costs from kilobytes to a few megabytes
MAX_SPEC_CHARS = 128 << 10  # a schema, pattern or grammar longer than this is refused: its compile grows with it

_LOCATION = re.compile(r"^\[[^\]]*\] \S+:\d+: ")
_CHECK = re.compile(r"^Check failed: .*? is false: ")


class Grammars:
    """The engine's grammar compiler and its cache; each request's matcher lives on its record."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compiler = None  # built on first use
        self._cache: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()  # compile runs in worker threads, admission on the engine's

    def compile(self, spec: StructuredOutput):
        """The compiled grammar, from the cache or compiled now; SamplingParamError if it is invalid.
        Thread-safe: the server calls it from worker threads."""
        if len(spec.spec or "") > MAX_SPEC_CHARS:
            raise SamplingParamError(spec.param, f"The {spec.kind} is {len(spec.spec)} characters long; this server "
                                                 f"compiles at most {MAX_SPEC_CHARS}.")
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
            compiler = self._get_compiler()
        try:
            compiled = _compile(compiler, spec)
        except RuntimeError as exc:  # xgrammar's errors for a bad schema, pattern or grammar
            raise SamplingParamError(spec.param, f"The {spec.kind} cannot be compiled: {_reason(exc)}") from None
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutput):
        """A new matcher for one request (each of n samples has its own), at the grammar's start."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(spec), override_stop_tokens=self._stop_token_ids or None)

    def mask(self, logits: torch.Tensor, rows: list[int], matchers: list) -> None:
        """Set, in place, the logits of tokens the grammar forbids to -inf, in `rows` only
        (`matchers[k]` is row `rows[k]`'s)."""
        import xgrammar

        assert rows and len(rows) == len(matchers)
        bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], self._vocab_size)
        for i, matcher in zip(rows, matchers):
            matcher.fill_next_token_bitmask(bitmask, i)
        with torch.inference_mode():  # the runner made the logits as inference tensors
            xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar

            if self._tokenizer is None:
                raise SamplingParamError("response_format", "Structured output needs a tokenizer, and this model has none.")
            info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


def accept(matcher, token: int) -> bool:
    """Advance a matcher by its request's sampled token; False when the request is done: its
    grammar ended (a stop token was accepted), or it refused the token, which only happens when
    other settings forbade every token the grammar allows (min_tokens masking the only stop
    token): then the output can never match, and it ends here."""
    return matcher.accept_token(token) and not matcher.is_terminated()


def _compile(compiler, spec: StructuredOutput):
    # Compact JSON (no free whitespace): a small model left free to add whitespace may add it forever.
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.spec, any_whitespace=False, strict_mode=spec.strict)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.spec)
    if spec.kind == "structural_tag":
        return _compile_structural_tag(compiler, json.loads(spec.spec))
    return compiler.compile_grammar(spec.spec)


def _compile_structural_tag(compiler, tag: dict):
    """xgrammar's own format as it is; the older structures-and-triggers form (vLLM's and SGLang's
    response_format) through xgrammar's call for it."""
    if "format" in tag:
        return compiler.compile_structural_tag(json.dumps(tag))
    import xgrammar

    items = [xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
             for s in tag["structures"]]
    return compiler.compile_structural_tag(items, tag["triggers"])


def _reason(exc: RuntimeError) -> str:
    """xgrammar's message without its time, C++ source location and failed-check prefixes."""
    text = _LOCATION.sub("", str(exc).strip())
    return _CHECK.sub("", text)

