"""Structured output: a grammar that a request's tokens must follow, enforced while sampling.

A request names its grammar with a `StructuredOutput` spec on its SamplingParams (a JSON
schema, any JSON object, a regular expression, an EBNF grammar, or a structural tag: free
text in which each trigger starts a tagged region whose content is constrained). `Grammars` compiles a
spec against the engine's tokenizer with xgrammar and keeps one `GrammarMatcher` per
constrained engine request (so each of n samples has its own state). In a step, the
matchers of the constrained rows write their allowed tokens into a bitmask, the bitmask
sets every other token's logit to -inf in those rows only, and after sampling each matcher
advances by its row's token. A step with no constrained row does none of this.

Why compile off the engine: a schema compiles in milliseconds to minutes, and the engine's
step must not wait on it. The server compiles in a worker thread before admission
(`compile`, which also turns a bad spec into a SamplingParamError); admission then finds
the compiled grammar in a small LRU keyed by the spec. The compile itself runs in a process of
its own (trillm/engine/grammar_compiler.py, a handler of trillm/fork_jobs.py), which is killed
when it runs past the engine's `grammar_compile_timeout`: xgrammar cannot be interrupted
in-process, and an abandoned compile would hold a core for as long as it ran. The tokenizer's
xgrammar view, which takes most of a second to build, is made once per engine, on first use,
and handed to each compiler process.

A matcher's state depends only on the request's output tokens, which a preempted request
keeps, so preemption needs nothing here. When a grammar is complete, only the stop tokens
(the engine's EOS ids) are allowed; the scheduler then finishes the request as on any EOS.
xgrammar is imported on first use: the import takes seconds, and most engines never
constrain a request.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch

from trillm.engine.grammar_compiler import CompileFailed, CompilerProcess, CompileTimeout
from trillm.fork_jobs import WorkerClosed, WorkerOnDemand
from trillm.sampling_params import SamplingParamError, StructuredOutput

log = logging.getLogger(__name__)
CACHE_SIZE = 64  # compiled grammars kept; one costs from kilobytes to a few megabytes
MAX_SPEC_CHARS = 128 << 10  # a schema, pattern or grammar longer than this is refused: its compile grows with it
COMPILE_SLOTS = 2  # quick compiles at once (in one compiler process, started when first needed)
QUICK_COMPILE_S = 1.0  # a compile's first try; one that needs longer is done again in the slow lane
SLOW_MEMORY = 256  # specs remembered as slow, which go to the slow lane at once


class SlowCompile(Exception):
    """The spec did not compile within QUICK_COMPILE_S: compile it again in the slow lane."""


class Grammars:
    """The engine's grammar compiler and its cache; each request's matcher lives on its record.
    `close()` stops the compiler process (idempotent; a compile after it starts a new one).

    Two lanes, so that slow schemas cannot hold every compile slot while an ordinary one waits:
    a quick compile (`quick=True`) gets COMPILE_SLOTS slots and QUICK_COMPILE_S; a spec that
    needs longer is stopped and raises SlowCompile, and the caller compiles it again with the
    whole timeout in the slow lane, whose one slot the caller keeps to one compile at a time."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], compile_timeout: float):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compile_timeout = compile_timeout
        self._info = None  # the tokenizer's xgrammar view, built on first use
        self._cache: OrderedDict[StructuredOutput, tuple[object, str]] = OrderedDict()  # compiled, serialized
        self._slow: OrderedDict[StructuredOutput, None] = OrderedDict()  # known to need the slow lane
        self._compilers = WorkerOnDemand()  # started on the first compile that misses the cache
        self._lock = threading.Lock()  # compile runs in worker threads, admission on the engine's

    @classmethod
    def of(cls, tokenizer, config, compile_timeout: float) -> Grammars:
        """A model's compiler (`config`: its ModelConfig): its vocabulary, its EOS ids as stop tokens."""
        return cls(tokenizer, config.hf_config.vocab_size, list(config.eos_token_ids), compile_timeout)

    def compile(self, spec: StructuredOutput, quick: bool = False):
        """The compiled grammar, from the cache or compiled now; SamplingParamError if it is
        invalid or does not compile within the timeout (the compile is then stopped); with
        `quick`, SlowCompile if it needs longer than QUICK_COMPILE_S (or did so before).
        Thread-safe: the server calls it from worker threads. Blocks while every slot of its lane
        is busy, and for at most its time (plus a process start) once its own compile runs."""
        if len(spec.spec or "") > MAX_SPEC_CHARS:
            raise SamplingParamError(spec.param, f"The {spec.kind} is {len(spec.spec)} characters long; this server "
                                                 f"compiles at most {MAX_SPEC_CHARS}.")
        budget = min(QUICK_COMPILE_S, self._compile_timeout) if quick else self._compile_timeout
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec][0]
            if budget < self._compile_timeout and spec in self._slow:
                raise SlowCompile
            info = self._tokenizer_info()
        try:
            # COMPILE_SLOTS quick slots and the slow lane's one
            compiler = self._compilers.get(lambda: CompilerProcess(info.serialize_json(), COMPILE_SLOTS + 1))
            serialized = compiler.compile(spec.kind, spec.spec, spec.strict, budget)
        except CompileFailed as exc:
            raise SamplingParamError(spec.param, f"The {spec.kind} cannot be compiled: {exc}") from None
        except CompileTimeout:
            if budget < self._compile_timeout:
                with self._lock:
                    self._slow[spec] = None
                    while len(self._slow) > SLOW_MEMORY:
                        self._slow.popitem(last=False)
                raise SlowCompile from None
            raise SamplingParamError(spec.param, f"The {spec.kind} did not compile within "
                                                 f"{self._compile_timeout:g} s; send a simpler one.") from None
        except WorkerClosed:  # the engine is closing
            raise SamplingParamError(spec.param, f"The {spec.kind} was not compiled: the server is stopping.") from None
        except RuntimeError:
            log.exception("Compiling a %s failed", spec.kind)
            raise SamplingParamError(spec.param, f"The {spec.kind} could not be compiled.") from None
        return self._keep(spec, serialized, info)

    def serialized(self, spec: StructuredOutput) -> str:
        """A compiled spec's grammar as xgrammar serializes it (for the engine's process, whose
        `insert_serialized` takes it); KeyError if it is not in the cache."""
        with self._lock:
            return self._cache[spec][1]

    def insert_serialized(self, grammars: dict[StructuredOutput, str]) -> None:
        """Cache grammars a front compiled (`serialized`), so that admitting their requests compiles nothing."""
        with self._lock:
            info = self._tokenizer_info()
        for spec, serialized in grammars.items():
            if spec not in self._cache:
                self._keep(spec, serialized, info)

    def _keep(self, spec: StructuredOutput, serialized: str, info):
        import xgrammar

        compiled = xgrammar.CompiledGrammar.deserialize_json(serialized, info)
        with self._lock:
            self._cache[spec] = (compiled, serialized)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def close(self) -> None:
        self._compilers.close()

    def matcher(self, spec: StructuredOutput):
        """A new matcher for one request (each of n samples has its own), at the grammar's start."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(spec), override_stop_tokens=self._stop_token_ids or None)

    def mask(self, logits: torch.Tensor, constrained: list[tuple[int, object, list[int]]]) -> None:
        """Set, in place, the logits of tokens the grammar forbids to -inf. `constrained`: per
        constrained request, (its first row, its matcher, its drafts): row first + j gets the mask
        of the matcher's state after drafts[:j] (drafts in verification, trillm/engine/verification.py).
        Rows after a draft the grammar refuses or ends on are left as they are: verification
        never keeps a token past that draft. Each matcher is back in its state after."""
        import xgrammar

        assert constrained
        bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], self._vocab_size)
        rows = []
        for first, matcher, drafts in constrained:
            accepted = 0
            for j in range(len(drafts) + 1):
                matcher.fill_next_token_bitmask(bitmask, first + j)
                rows.append(first + j)
                if j == len(drafts) or not matcher.accept_token(drafts[j]):  # a refused token changes nothing
                    break
                accepted += 1
                if matcher.is_terminated():
                    break
            if accepted:
                matcher.rollback(accepted)
        with torch.inference_mode():  # the runner made the logits as inference tensors
            xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)

    def _tokenizer_info(self):
        """The tokenizer's xgrammar view (the caller holds the lock)."""
        if self._info is None:
            import xgrammar

            if self._tokenizer is None:
                raise SamplingParamError("response_format", "Structured output needs a tokenizer, and this model has none.")
            self._info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size)
        return self._info


def accept(matcher, token: int) -> bool:
    """Advance a matcher by its request's sampled token; False when the request is done: its
    grammar ended (a stop token was accepted), or it refused the token, which only happens when
    other settings forbade every token the grammar allows (min_tokens masking the only stop
    token): then the output can never match, and it ends here."""
    return matcher.accept_token(token) and not matcher.is_terminated()
