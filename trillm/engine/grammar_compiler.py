"""Grammar compiles in processes of their own, so that one that runs too long can be stopped.

xgrammar compiles in C++ that no Python thread can interrupt: a schema that takes a minute
holds a core for that minute, long after its request was refused. Here every compile runs in a
fork of a worker process (trillm/fork_jobs.py), killed when its time is up; this module is the
worker's handler (`setup`: the tokenizer's xgrammar view, once; `run`: one compile) and the
engine's door to it (`CompilerProcess`).

A job: {"kind", "spec", "strict"}; its reply: {"grammar": xgrammar's serialized CompiledGrammar}
or {"error": why the spec is invalid or admits no output}.
"""
from __future__ import annotations

import json
import re

from trillm.engine.grammar_productive import admits_output
from trillm.fork_jobs import ForkWorker, JobOutOfMemory, JobTimeout

_LOCATION = re.compile(r"^\[[^\]]*\] \S+:\d+: ")
_CHECK = re.compile(r"^Check failed: .*? is false: ")


class CompileTimeout(Exception):
    """The compile ran past its time and was stopped."""


class CompileFailed(Exception):
    """The spec is not a valid grammar of its kind; the message says why (xgrammar's words)."""


class CompilerProcess(ForkWorker):
    """The worker process with `slots` compiles at once, given the tokenizer's xgrammar view
    (RuntimeError if it does not start); a ForkWorker whose jobs are compiles."""

    def __init__(self, tokenizer_info_json: str, slots: int):
        super().__init__(__name__, tokenizer_info_json.encode(), slots, "grammar compiler")

    def compile(self, kind: str, spec: str, strict: bool, timeout: float) -> str:
        """xgrammar's serialized CompiledGrammar for the spec. Raises CompileFailed for an
        invalid spec, CompileTimeout if it compiled for longer than `timeout` seconds (that
        compile was killed), WorkerClosed if the process was closed, RuntimeError if it failed.
        Blocks until a slot is free, then for at most the timeout and the worker's grace."""
        try:
            reply = self.run({"kind": kind, "spec": spec, "strict": strict}, timeout)
        except JobTimeout:
            raise CompileTimeout from None
        except JobOutOfMemory:  # no limit is set: xgrammar's own allocation failed
            raise RuntimeError("the grammar compiler ran out of memory on this spec") from None
        if "grammar" in reply:
            return reply["grammar"]
        raise CompileFailed(reply["error"])


def setup(tokenizer_info_json: bytes):
    """The worker's compiler, for the tokenizer's xgrammar view."""
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info_json.decode())
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def run(compiler, job: dict) -> dict:
    """One compile, in a fork of the worker."""
    try:
        compiled = _compile_spec(compiler, job["kind"], job["spec"], job["strict"])
        if not _admits_an_output(compiled):
            return {"error": "it admits no finite output (a schema that requires itself, or rules that only "
                             "refer to each other)"}
    except RuntimeError as exc:  # xgrammar's errors for a bad schema, pattern or grammar
        return {"error": _reason(exc)}
    return {"grammar": compiled.serialize_json()}


def _compile_spec(compiler, kind: str, spec: str, strict: bool):
    """A spec compiled by an xgrammar GrammarCompiler (in a fork)."""
    # Compact JSON (no free whitespace): a small model left free to add whitespace may add it forever.
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "json_schema":
        return compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=strict)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "structural_tag":
        return _compile_structural_tag(compiler, json.loads(spec))
    return compiler.compile_grammar(spec)


def _compile_structural_tag(compiler, tag: dict):
    """xgrammar's own format as it is; the older structures-and-triggers form (vLLM's and SGLang's
    response_format) through xgrammar's call for it."""
    if "format" in tag:
        return compiler.compile_structural_tag(json.dumps(tag))
    import xgrammar

    items = [xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
             for s in tag["structures"]]
    return compiler.compile_structural_tag(items, tag["triggers"])


def _admits_an_output(compiled) -> bool:
    """Whether the compiled grammar admits a finite output that this vocabulary can begin. A
    grammar whose rules never end (a required property that is the schema itself) would run a
    request to its length limit without valid JSON; one that lets no token begin nor may end at
    once ({"$ref": "#"}, two definitions that only refer to each other) would leave every token
    masked: both refused here rather than run."""
    import xgrammar

    if not admits_output(str(compiled.grammar)):
        return False
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    return bool(mask.any()) or matcher.is_terminated()


def _reason(exc: RuntimeError) -> str:
    """xgrammar's message without its time, C++ source location and failed-check prefixes."""
    text = _LOCATION.sub("", str(exc).strip())
    return _CHECK.sub("", text)
