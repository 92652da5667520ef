"""EngineProcess: the engine core in a process of its own, and the server's link to it.

Why: in one process the step's thread and the event loop take the interpreter's lock in turn, so
a step waits for every token's send before it, and the served rate falls far below the engine's
own wherever the step is short (a GPU; a small model). In its own process the core steps while
the server's loop frames and sends; each Round (trillm/engine/rounds.py: every request's new
tokens of one trip) crosses as one message.

The wire: two ZeroMQ PUSH/PULL pairs over IPC sockets in a private directory (0700), which only
this user's processes can open. Commands go one message each, pickled (a request group with its
prompts and parameters; pickled off the event loop, `prepare`); an empty message stops the engine.
Back come msgspec-encoded Rounds (errors and pooled tensors inside them pickled, as msgpack
extensions), after a first message that says the engine is ready (its config, settings and
tokenizer, pickled) or why it failed to load (the exception, re-raised in the server).

The engine's side (`serve_core`) is a plain loop: it waits for commands while it has nothing to
step, takes every queued one between two steps, and runs the same trips as StepThread. It ignores
SIGINT and SIGTERM (the server decides when it stops, after a drain that needs it stepping) and is
killed when the server ends (trillm.subprocesses.die_with_parent). A step's error is sent, and the
process ends.

Ownership: the server's Trio thread alone submits and runs the link; `start` and `close` block
(run them in a worker thread, or before the loop starts). `close()` is idempotent.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import msgspec
import torch
import trio
import zmq

from trillm.config import EngineArgs
from trillm.engine.core import EngineCore, check_request
from trillm.engine.errors import EngineUnavailableError
from trillm.engine.group import RequestGroup
from trillm.engine.rounds import CALLS, Admit, Call, Command, Round, RoundRunner, trips
from trillm.engine.stats import EngineStats
from trillm.engine.structured_output import Grammars
from trillm.model.loader import ModelConfig, resolve_device
from trillm.model.lora import LoRAAdapter, LoRARegistry
from trillm.pooling_params import PoolingParams
from trillm.sampling_params import SamplingParams
from trillm.subprocesses import die_with_parent

log = logging.getLogger(__name__)
READY, FAILED = b"R", b"F"  # the first message's tag
STOP = b""  # the command that ends the engine's loop
LINGER_MS = 5000  # how long a closing socket may still try to deliver (the last Round, a shutdown)
JOIN_S = 10.0  # how long `close` waits for the engine's process to end before it kills it
EXIT_GRACE_S = 0.5  # once the engine's process has ended, how long what it sent last may take to arrive
PICKLED = 1  # msgpack extension code: an exception or a tensor, pickled
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [engine] %(message)s"


@dataclass(frozen=True)
class Ready:
    """What the server needs of a loaded engine: what it serves, and how (its LoRA adapters'
    records, without their weights)."""

    config: ModelConfig
    args: EngineArgs
    tokenizer: object
    stats: EngineStats
    adapters: list[LoRAAdapter]


def faster_in_own_process(args: EngineArgs) -> bool:
    """Whether an engine serves faster in a process of its own: on a GPU, whose steps are short
    enough that in one process they wait on the loop's sends (benchmarks/README.md, the host
    path); not on a CPU, where the default model's step is long, the neutral runs measured no
    gain, and a second interpreter costs its memory."""
    return resolve_device(args.device).type == "cuda"


def _pickled(value) -> bytes:
    """A value as a Round carries it pickled (an exception, a call's reply); one that does not
    survive pickling crosses as a RuntimeError naming it."""
    try:
        data = pickle.dumps(value)
        pickle.loads(data)
    except Exception:  # noqa: BLE001 - any failure to rebuild it
        data = pickle.dumps(RuntimeError(repr(value)))
    return data


def _enc_hook(obj):
    if isinstance(obj, torch.Tensor):  # a pooled vector: on the host, so the server never touches the device
        return msgspec.msgpack.Ext(PICKLED, pickle.dumps(obj.cpu()))
    if isinstance(obj, BaseException):
        return msgspec.msgpack.Ext(PICKLED, _pickled(obj))
    raise NotImplementedError(f"a Round cannot carry {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview):
    assert code == PICKLED, code
    return pickle.loads(data)


def _dec_hook(kind: type, obj):
    if isinstance(obj, kind):  # a pickled extension, already rebuilt by _ext_hook
        return obj
    raise NotImplementedError(kind)


def serve_core(args: EngineArgs, commands_address: str, rounds_address: str, server_pid: int, log_level: int) -> None:
    """The engine's process: load, say so, then apply commands and step until told to stop (or a
    step fails). See the module docstring. It logs at the server's level, its lines marked."""
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    # A terminal's Ctrl-C, or a service manager's SIGTERM, reaches every process of the group: the
    # server drains on it, which needs this process stepping. It stops when the server says so,
    # or dies when the server does.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    die_with_parent(signum=signal.SIGKILL)
    if os.getppid() != server_pid:  # the server ended before the line above could tie us to it
        return
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    rounds = context.socket(zmq.PUSH)
    for sock in (commands, rounds):
        sock.setsockopt(zmq.LINGER, LINGER_MS)
    commands.connect(commands_address)
    rounds.connect(rounds_address)
    try:
        try:
            core = EngineCore(args)
        except BaseException as exc:
            rounds.send(FAILED + _pickled(exc))
            return
        with core:
            adapters = [] if core.loras is None else [replace(a, weights=None) for a in core.loras.adapters.values()]
            rounds.send(READY + pickle.dumps(Ready(core.config, core.args, core.tokenizer, core.stats(), adapters)))
            runner = RoundRunner(core)
            encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
            while (received := _receive(commands, wait=not core.has_unfinished())) is not None:
                for call in [c for c in received if isinstance(c, Call) and c.beside]:
                    threading.Thread(target=_call_beside, args=(core, call, context, rounds_address), daemon=True,
                                     name=f"trillm-{call.method}").start()
                for trip in trips([c for c in received if not (isinstance(c, Call) and c.beside)]):
                    done = runner.run(*trip)
                    done.replies = [(call_id, _reply(reply)) for call_id, reply in done.replies]
                    rounds.send(encoder.encode(done), copy=False)
                    if done.error is not None:
                        return
    finally:
        context.destroy(linger=LINGER_MS)


def _reply(value) -> msgspec.msgpack.Ext:
    """A call's reply, pickled: it may be any record (msgspec would send a dataclass as a plain map)."""
    return msgspec.msgpack.Ext(PICKLED, _pickled(value))


def _call_beside(core: EngineCore, call: Call, context: zmq.Context, rounds_address: str) -> None:
    """A Call the core lets run while it steps (Call.beside), in this thread; its reply goes on a
    socket of its own (ZeroMQ's sockets belong to one thread each), in a Round of its own."""
    assert call.method in CALLS, call.method
    try:
        reply = getattr(core, call.method)(*call.args)
    except Exception as exc:  # noqa: BLE001 - the caller's error, not the engine's death
        reply = exc
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.connect(rounds_address)
    try:
        sock.send(msgspec.msgpack.encode(Round(admissions=[], outputs=[], replies=[(call.call_id, _reply(reply))])))
    finally:
        sock.close()


def _receive(commands: zmq.Socket, wait: bool) -> list[Command] | None:
    """Every queued command (waiting for one first if `wait`); None once told to stop."""
    if wait:
        commands.poll()
    received = []
    while True:
        try:
            message = commands.recv(zmq.NOBLOCK)
        except zmq.Again:
            return received
        if message == STOP:
            return None
        received.append(pickle.loads(message))


class EngineProcess:
    """The server's side: what AsyncEngine reads of a core (`config`, `args`, `tokenizer`, `loras`,
    `grammars`, `check_request`, `stats`), and the link it drives (`prepare`, `submit`, `run`,
    `after_death`). Structured-output specs compile here (the server's own compiler processes),
    and their grammars travel with the request to the engine's process. LoRA adapters are read
    (and checked) here too, and travel with the call that loads them."""

    def __init__(self, args: EngineArgs):
        """Start the engine's process and wait until it has loaded (blocks: seconds to minutes).
        Raises what loading raised there, or EngineUnavailableError if the process died first."""
        self._closed = False
        self._dir = tempfile.mkdtemp(prefix="trillm-engine-")  # 0700: this user's processes alone
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._rounds = self._context.socket(zmq.PULL)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # a send never blocks the loop: commands are few and small
        for sock in (self._commands, self._rounds):
            sock.setsockopt(zmq.LINGER, 0)
        commands_address = f"ipc://{self._dir}/commands"
        rounds_address = f"ipc://{self._dir}/rounds"
        self._commands.bind(commands_address)
        self._rounds.bind(rounds_address)
        self._decoder = msgspec.msgpack.Decoder(type=Round, ext_hook=_ext_hook, dec_hook=_dec_hook)
        self.process = None
        self.grammars: Grammars | None = None
        try:
            # Spawned, not forked: nothing of the server's threads or state comes along, and no fork
            # server stays resident beside the two processes.
            self.process = multiprocessing.get_context("spawn").Process(
                target=serve_core, name="trillm-engine", daemon=args.tensor_parallel_size == 1,
                args=(args, commands_address, rounds_address, os.getpid(), logging.getLogger().getEffectiveLevel()))
            self.process.start()
            ready = self._wait_ready()
        except BaseException:
            self.close()
            raise
        self.config, self.args, self.tokenizer, self._stats = ready.config, ready.args, ready.tokenizer, ready.stats
        # The adapters requests may name, as the engine's process last said (its registry is the
        # truth: it refuses what this copy let through); their records only, never their weights.
        self.loras: LoRARegistry | None = None
        if self.args.enable_lora:
            self.loras = LoRARegistry(self.config.hf_config, self.args.max_lora_rank, 1)
            self.loras.adapters.update((a.name, a) for a in ready.adapters)
        self.grammars = Grammars.of(self.tokenizer, self.config, self.args.grammar_compile_timeout)
        log.info("the engine runs in process %d", self.process.pid)

    def _wait_ready(self) -> Ready:
        while not self._rounds.poll(200):
            if not self.process.is_alive():
                raise EngineUnavailableError(
                    f"The engine's process exited while loading (code {self.process.exitcode}).")
        message = self._rounds.recv()
        if message[:1] == FAILED:
            raise pickle.loads(message[1:])
        assert message[:1] == READY
        return pickle.loads(message[1:])

    # --- what AsyncEngine reads of a core ------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams):
        """trillm.engine.core.check_request, against what the engine's process serves."""
        return check_request(self.config, self.args, self.loras, prompt_token_ids, params)

    def stats(self) -> EngineStats:
        """The stats the engine's process had when it was ready (AsyncEngine keeps each Round's after)."""
        return self._stats

    # --- the link -----------------------------------------------------------------------------

    async def prepare(self, requests: RequestGroup) -> bytes:
        """The group's Admit, with the grammars its specs compiled to (Admission compiled them
        here), pickled in a worker thread: it grows with the prompts."""
        return await trio.to_thread.run_sync(self._encode_admit, requests)

    def _encode_admit(self, requests: RequestGroup) -> bytes:
        specs = {m.params.structured_output for m in requests.members if isinstance(m.params, SamplingParams)} - {None}
        grammars = {}
        for spec in specs:
            self.grammars.compile(spec)  # from the cache, where Admission left it
            grammars[spec] = self.grammars.serialized(spec)
        return pickle.dumps(Admit(requests, grammars or None))

    def submit(self, command: Command | bytes) -> None:
        """Send a command (or a prepared one) to the engine's process. Never blocks; a command
        sent after the process died is lost with it (the engine's death fails every group)."""
        try:
            self._commands.send(command if isinstance(command, bytes) else pickle.dumps(command), zmq.NOBLOCK)
        except zmq.Again:
            pass  # no engine connected: it died, and `run` says so

    async def run(self, settle: Callable[[Round], None]) -> None:
        """Settle every Round the engine's process sends, as it comes. Raises a step's error once
        its Round is settled, and EngineUnavailableError when the process ends without one."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_exit)
                await self._receive(settle)
        except ExceptionGroup as group:  # one of the two tasks ended the engine: its error is the account
            raise group.exceptions[0] from None

    async def _receive(self, settle: Callable[[Round], None]) -> None:
        fd = self._rounds.getsockopt(zmq.FD)
        while True:
            try:
                message = self._rounds.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                # The socket's descriptor only signals a change; recv above drained what it had.
                await trio.lowlevel.wait_readable(fd)
                continue
            done = self._decoder.decode(message.buffer)
            settle(done)
            if done.error is not None:
                raise done.error

    async def _watch_exit(self) -> None:
        await trio.lowlevel.wait_readable(self.process.sentinel)
        # What it sent before it ended is settled first (`run` goes on meanwhile): its last Round
        # may carry the step's error, which is the better account of its death.
        await trio.sleep(EXIT_GRACE_S)
        self.process.join()
        raise EngineUnavailableError(f"The engine's process exited (code {self.process.exitcode}).")

    def after_death(self) -> None:
        """The engine died: its process ends (if it has not), and with it every request's blocks."""
        if self.process is not None and self.process.is_alive():
            self.process.kill()

    def close(self) -> None:
        """Stop the engine's process (told to, then killed after JOIN_S), close the sockets.
        Idempotent; blocks while the process ends."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.process is not None and self.process.is_alive():
                self._commands.send(STOP, zmq.NOBLOCK)
                self.process.join(JOIN_S)
                if self.process.is_alive():
                    log.warning("the engine's process did not stop within %g s: killing it", JOIN_S)
                    self.process.kill()
                    self.process.join()
        except zmq.Again:
            self.process.kill()
            self.process.join()
        finally:
            if self.grammars is not None:
                self.grammars.close()
            self._context.destroy(linger=0)
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
