"""Grammar compiles in processes of their own, so that one that runs too long can be stopped.

xgrammar compiles in C++ that no Python thread can interrupt: a schema that takes a minute
holds a core for that minute, long after its request was refused. Here every compile runs in
a process forked for it, which is killed when its time is up.

The forks come from a worker process (`python -m trillm.engine.grammar_compiler`), not from
the server: the server runs many threads (torch's, the engine's, Trio's) and a fork copies the
locks they hold but not the threads, while the worker holds xgrammar and the tokenizer's
xgrammar view and little else. So a compile starts in a fork's time, and a kill costs no
restart. The worker has a fixed number of slots, each a pair of pipes, one compile at a time
on each; it waits on all of them and on its forks at once (multiprocessing.connection.wait).

On each slot, in multiprocessing.connection's framing, JSON messages:
  server -> worker  (slot 0 only, once) the tokenizer's view, xgrammar's serialized TokenizerInfo;
  worker -> server  (slot 0 only, once) {"ready": true};
  server -> worker  {"kind", "spec", "strict", "timeout"}, one compile;
  worker -> server  {"grammar": xgrammar's serialized CompiledGrammar} | {"error": why the spec
                    is invalid} | {"timeout": true} | {"crashed": true}.
"""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from trillm.engine.grammar_productive import admits_output
from trillm.subprocesses import die_with_parent, spawn

START_TIMEOUT_S = 120.0  # importing xgrammar (and torch, which it imports) on a busy machine
REPLY_GRACE_S = 5.0  # beyond a compile's timeout, for the worker to stop the fork and answer

_LOCATION = re.compile(r"^\[[^\]]*\] \S+:\d+: ")
_CHECK = re.compile(r"^Check failed: .*? is false: ")


class CompileTimeout(Exception):
    """The compile ran past its time and was stopped."""


class CompilerClosed(RuntimeError):
    """The process was closed by its owner while the compile waited or ran."""


class CompileFailed(Exception):
    """The spec is not a valid grammar of its kind; the message says why (xgrammar's words)."""


@dataclass
class _Slot:
    """The server's ends of one slot's pipes."""

    replies: Connection
    requests: Connection

    def close(self) -> None:
        self.requests.close()
        self.replies.close()


class CompilerProcess:
    """One worker process with `slots` compiles at once. The constructor starts it and waits
    until it is ready (RuntimeError if it is not within START_TIMEOUT_S). It dies with the server.

    Thread-safe: `compile` takes a free slot (waiting for one while all are busy). If the
    worker fails, it is killed and `alive` turns False; the compiles in flight then fail too.
    `close()` kills it (idempotent; compiles in flight fail); the object is a context manager."""

    def __init__(self, tokenizer_info_json: str, slots: int):
        assert slots >= 1
        server_ends, worker_fds = [], []
        for _ in range(slots):
            reply_read, reply_write = os.pipe()
            request_read, request_write = os.pipe()
            server_ends.append(_Slot(Connection(reply_read, writable=False), Connection(request_write, readable=False)))
            worker_fds += [request_read, reply_write]
        try:
            self._process = spawn([sys.executable, "-m", __name__, *map(str, worker_fds)], pass_fds=worker_fds,
                                  stdin=subprocess.DEVNULL)
        except BaseException:
            for slot in server_ends:
                slot.close()
            raise
        finally:
            for fd in worker_fds:
                os.close(fd)
        self.closed = False
        self._free: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        for slot in server_ends:
            self._free.put(slot)
        first = server_ends[0]
        try:
            first.requests.send_bytes(tokenizer_info_json.encode())
            if _reply(first, START_TIMEOUT_S) != {"ready": True}:
                raise RuntimeError("it answered something else")
        except (OSError, EOFError, RuntimeError) as exc:
            self.close()
            raise RuntimeError(f"the grammar compiler process did not start: {exc}") from None

    @property
    def alive(self) -> bool:
        return not self.closed and self._process.poll() is None

    def compile(self, kind: str, spec: str, strict: bool, timeout: float) -> str:
        """xgrammar's serialized CompiledGrammar for the spec. Raises CompileFailed for an
        invalid spec, CompileTimeout if it compiled for longer than `timeout` seconds (that
        compile was killed), CompilerClosed if it was closed, RuntimeError if the worker failed.
        Blocks until a slot is free, then for at most `timeout` + REPLY_GRACE_S."""
        slot = self._take_slot()
        try:
            slot.requests.send_bytes(json.dumps({"kind": kind, "spec": spec, "strict": strict,
                                                 "timeout": timeout}).encode())
            reply = _reply(slot, timeout + REPLY_GRACE_S)
        except (OSError, EOFError, RuntimeError) as exc:
            if self.closed:
                raise CompilerClosed("the grammar compiler process was closed") from None
            self.close()  # it no longer answers as it should: none of its slots is trusted
            raise RuntimeError(f"the grammar compiler process failed: {exc}") from None
        finally:
            self._free.put(slot)
            if self.closed:
                self._close_free_slots()
        if "grammar" in reply:
            return reply["grammar"]
        if "error" in reply:
            raise CompileFailed(reply["error"])
        if "timeout" in reply:
            raise CompileTimeout
        raise RuntimeError("the grammar compiler crashed on this spec")

    def _take_slot(self) -> _Slot:
        while not self.closed:
            try:
                return self._free.get(timeout=1.0)
            except queue.Empty:
                pass
        raise CompilerClosed("the grammar compiler process was closed")

    def close(self) -> None:
        self.closed = True
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._close_free_slots()  # a busy slot's compile closes it when it returns

    def _close_free_slots(self) -> None:
        while True:
            try:
                self._free.get_nowait().close()
            except queue.Empty:
                return

    def __enter__(self) -> CompilerProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _reply(slot: _Slot, timeout: float) -> dict:
    if not slot.replies.poll(timeout):
        raise RuntimeError(f"no answer within {timeout:g} s")
    return json.loads(slot.replies.recv_bytes())


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


@dataclass
class _Fork:
    """A compile in flight in the worker: the forked process, where its answer goes, and until when."""

    pid: int
    result: Connection
    reply_to: Connection
    deadline: float

    def end(self, reply: bytes | None) -> None:
        """Reap the fork and send its slot `reply`, or, given None, kill it first and send a timeout."""
        if reply is None:
            os.kill(self.pid, signal.SIGKILL)
            reply = b'{"timeout": true}'
        self.result.close()
        os.waitpid(self.pid, 0)
        try:
            self.reply_to.send_bytes(reply)
        except OSError:  # the server gave up on this slot (it is closing us)
            pass


def _fork_compile(compiler, request: dict, reply_to: Connection) -> _Fork:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the fork: compile, answer, and leave without running the worker's cleanup
        status = 0
        try:
            die_with_parent()  # the worker may be killed while its forks compile
            os.close(read_fd)
            try:
                compiled = _compile_spec(compiler, request["kind"], request["spec"], request["strict"])
                reply = {"grammar": compiled.serialize_json()} if _admits_an_output(compiled) else {
                    "error": "it admits no finite output (a schema that requires itself, or rules that only "
                             "refer to each other)"}
            except RuntimeError as exc:  # xgrammar's errors for a bad schema, pattern or grammar
                reply = {"error": _reason(exc)}
            Connection(write_fd, readable=False).send_bytes(json.dumps(reply).encode())
        except BaseException:
            status = 1
        finally:
            os._exit(status)
    os.close(write_fd)
    return _Fork(pid, Connection(read_fd, writable=False), reply_to, time.monotonic() + request["timeout"])


def _worker(fds: list[int]) -> None:
    """The worker's loop: requests in on every slot, one fork per request, each fork's answer (or
    its timeout) back on its slot. Ends when the server closes the slots."""
    slots = {Connection(fds[i], writable=False): Connection(fds[i + 1], readable=False)
             for i in range(0, len(fds), 2)}
    first = next(iter(slots))
    # Python warns on a fork beside other threads; the ones here (torch's, idle) hold nothing
    # the compile takes, and the fork runs only the compile.
    warnings.filterwarnings("ignore", message=".*multi-threaded.*fork", category=DeprecationWarning)
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(first.recv_bytes().decode())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    slots[first].send_bytes(b'{"ready": true}')
    forks: dict[Connection, _Fork] = {}
    while slots or forks:
        timeout = max(0.0, min(f.deadline for f in forks.values()) - time.monotonic()) if forks else None
        for conn in wait([*slots, *forks], timeout):
            if conn in forks:
                fork = forks.pop(conn)
                try:
                    reply = conn.recv_bytes()
                except EOFError:  # it died without answering
                    reply = b'{"crashed": true}'
                fork.end(reply)
                continue
            try:
                request = json.loads(conn.recv_bytes())
            except EOFError:  # the server closed this slot
                del slots[conn]
                continue
            fork = _fork_compile(compiler, request, slots[conn])
            forks[fork.result] = fork
        now = time.monotonic()
        for conn, fork in list(forks.items()):
            if fork.deadline <= now:
                del forks[conn]
                fork.end(None)


if __name__ == "__main__":
    _worker([int(fd) for fd in sys.argv[1:]])
