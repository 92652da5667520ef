"""EngineProcess: the engine core in a process of its own, and a front's link to it (EngineLink).

Why: in one process the step's thread and the event loop take the interpreter's lock in turn, so
a step waits for every token's send before it, and the served rate falls far below the engine's
own wherever the step is short (a GPU; a small model). In its own process (trillm/engine/
engine_main.py) the core steps while the server's loop frames and sends; each Round
(trillm/engine/rounds.py: every request's new tokens of one trip) crosses as one message.

The link: a ZeroMQ PUSH/PULL pair each way over IPC sockets in a private directory (0700), which
the front binds and the engine's process connects to; what crosses them: trillm/engine/wire.py.
The server's process is the first front, which starts the engine's process; with
`--api-server-count` the other fronts (trillm/launch/fronts.py) each bind a pair of their own,
and the engine's process tells them apart (trillm/engine/front_links.py).

Ownership: the server's Trio thread alone submits and runs the link; the constructor and
`close` block (run them in a worker thread, or before the loop starts). `close()` is idempotent.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import select
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import trio
import zmq

from trillm.config import EngineArgs
from trillm.engine.core import check_request
from trillm.engine.engine_main import serve_core
from trillm.engine.errors import EngineUnavailableError
from trillm.engine.group import RequestGroup
from trillm.engine.rounds import Admit, Command, Round
from trillm.engine.stats import EngineStats
from trillm.engine.structured_output import Grammars
from trillm.engine.wire import FAILED, READY, STOP, Ready, round_decoder
from trillm.model.loader import resolve_device
from trillm.model.lora import LoRAAdapter, LoRARegistry
from trillm.pooling_params import PoolingParams
from trillm.sampling_params import SamplingParams
from trillm.subprocesses import start_process

log = logging.getLogger(__name__)
JOIN_S = 10.0  # how long `close` waits for the engine's process to end before it kills it
EXIT_GRACE_S = 0.5  # once the engine's process has ended, how long what it sent last may take to arrive
READY_FILE = "ready.pickle"  # in the fronts' directory: the engine's Ready, for the fronts other than the first
LINK_POLL_MS = 200  # while a front waits for the engine's process to connect, how often it checks that one runs


def faster_in_own_process(args: EngineArgs) -> bool:
    """Whether an engine serves by default in a process of its own: on a GPU, whose steps are
    short enough that in one process they wait on the loop's sends (benchmarks/README.md, the host
    path). On a CPU it serves the default model 4-24% faster there too, but the server's process
    alone (its tokenizer comes through transformers, which imports torch) holds more than the
    in-place memory bound of serving a small file leaves: opt-in there."""
    return resolve_device(args.device).type == "cuda"


@dataclass(frozen=True)
class FrontSpec:
    """What a front process needs to reach the engine's process (EngineLink): its pair of
    addresses (which it binds), the engine's pid (to watch it end), and what the engine serves."""

    index: int
    fronts: int  # how many fronts the engine serves
    directory: str  # the fronts' private directory (0700): their sockets, and what else they share
    commands_address: str
    rounds_address: str
    engine_pid: int
    # The engine's Ready, pickled, as a file in `directory` (None: the first front, which waits
    # for it). Not the Ready itself: spawning a front pickles its arguments into a pipe, and with
    # a tokenizer in them they outgrow it, so multiprocessing's start blocks until the child has
    # imported everything their unpickling needs, and the fronts started one after another.
    ready: str | None


class EngineLink:
    """One front's link to the engine's process: what AsyncEngine reads of a core (`config`,
    `args`, `tokenizer`, `loras`, `grammars`, `check_request`, `stats`), and the link it drives
    (`prepare`, `submit`, `run`, `after_death`). Structured-output specs compile here (the
    front's own compiler processes), and their grammars travel with the request to the engine's
    process. LoRA adapters are read (and checked) here too, and travel with the call that loads
    them. This class is a front the engine's process did not start (`--api-server-count`);
    EngineProcess, the first front, starts it."""

    def __init__(self, spec: FrontSpec):
        """Bind the front's sockets (the engine's process connects to them, before or after)."""
        self._closed = False
        self.index, self.fronts, self.directory = spec.index, spec.fronts, spec.directory
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._rounds = self._context.socket(zmq.PULL)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # a send never blocks the loop: commands are few and small
        for sock in (self._commands, self._rounds):
            sock.setsockopt(zmq.LINGER, 0)
        self._commands.bind(spec.commands_address)
        self._rounds.bind(spec.rounds_address)
        self._decoder = round_decoder()
        self.grammars: Grammars | None = None
        self._engine_pid = spec.engine_pid
        if spec.ready is not None:
            with open(spec.ready, "rb") as f:
                self._serve(pickle.load(f))

    def _serve(self, ready: Ready) -> None:
        self._wait_linked()
        self.config, self.args, self.tokenizer, self._stats = ready.config, ready.args, ready.tokenizer, ready.stats
        # The adapters requests may name, as the engine's process last said (its registry is the
        # truth: it refuses what this copy let through); their records only, never their weights.
        self.loras: LoRARegistry | None = None
        if self.args.enable_lora:
            self.loras = LoRARegistry(self.config.hf_config, self.args.max_lora_rank, 1)  # holds no weights
            self.follow_adapters(ready.adapters)
        self.grammars = Grammars.of(self.tokenizer, self.config, self.args.grammar_compile_timeout)

    def _wait_linked(self) -> None:
        """Block until the engine's process has connected to this front's commands socket. Until
        then the bound socket has no peer to queue a command for, so `submit` would lose it and
        its request would wait for ever: the engine's process connects to a front's address some
        time after the front binds it (its I/O thread retries the address until it is there).
        EngineUnavailableError if the process ends first."""
        while not self._commands.poll(LINK_POLL_MS, zmq.POLLOUT):
            if not self._engine_running():
                raise EngineUnavailableError("The engine's process exited before it linked to this front.")

    def _engine_running(self) -> bool:
        try:
            pidfd = os.pidfd_open(self._engine_pid)  # readable once it ends, though it is not our child
        except ProcessLookupError:
            return False
        try:
            return not select.select([pidfd], [], [], 0)[0]
        finally:
            os.close(pidfd)

    def follow_adapters(self, adapters: list[LoRAAdapter]) -> None:
        """The engine's registry as it now is (another front loaded or unloaded one)."""
        self.loras.adapters.clear()
        self.loras.adapters.update((a.name, a) for a in adapters)

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
        exit_code = await self._exited()
        # What it sent before it ended is settled first (`run` goes on meanwhile): its last Round
        # may carry the step's error, which is the better account of its death.
        await trio.sleep(EXIT_GRACE_S)
        raise EngineUnavailableError(f"The engine's process exited (code {exit_code}).")

    async def _exited(self) -> int | None:
        """When the engine's process has ended: its exit code, where this process can know it."""
        pidfd = os.pidfd_open(self._engine_pid)  # readable once it ends, though it is not our child
        try:
            await trio.lowlevel.wait_readable(pidfd)
        finally:
            os.close(pidfd)
        return None

    def after_death(self) -> None:
        """The engine died: the front that started it ends its process (EngineProcess)."""

    def close(self) -> None:
        """Close the sockets and the grammar compilers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.grammars is not None:
            self.grammars.close()
        self._context.destroy(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class EngineProcess(EngineLink):
    """The first front: it starts the engine's process (and, with `fronts` > 1, makes the other
    fronts' addresses: `front_specs`), and stops it."""

    def __init__(self, args: EngineArgs, fronts: int = 1):
        """Start the engine's process and wait until it has loaded (blocks: seconds to minutes).
        Raises what loading raised there, or EngineUnavailableError if the process died first."""
        self.directory = tempfile.mkdtemp(prefix="trillm-engine-")  # 0700: this user's processes alone
        self._addresses = [(f"ipc://{self.directory}/commands-{i}", f"ipc://{self.directory}/rounds-{i}")
                           for i in range(fronts)]
        self.process = None
        try:
            super().__init__(FrontSpec(0, fronts, self.directory, *self._addresses[0], engine_pid=0, ready=None))
            # Spawned, not forked: nothing of the server's threads or state comes along, and no fork
            # server stays resident beside the two processes.
            self.process = multiprocessing.get_context("spawn").Process(
                target=serve_core, name="trillm-engine", daemon=args.tensor_parallel_size == 1,
                args=(args, self._addresses, os.getpid(), logging.getLogger().getEffectiveLevel()))
            start_process(self.process)
            ready = self._wait_ready()
            self._engine_pid = self.process.pid
            self._serve(ready)
        except BaseException:
            self.close()
            raise
        log.info("the engine runs in process %d", self.process.pid)

    def front_specs(self) -> list[FrontSpec]:
        """What each other front needs to reach the engine (its sockets bind there, in its own process)."""
        ready = os.path.join(self.directory, READY_FILE)
        return [FrontSpec(i, self.fronts, self.directory, commands, rounds, self.process.pid, ready)
                for i, (commands, rounds) in enumerate(self._addresses) if i]

    def _wait_ready(self) -> Ready:
        """The engine's Ready, also written as it came (pickled) into READY_FILE for the other fronts."""
        while not self._rounds.poll(200):
            if not self.process.is_alive():
                raise EngineUnavailableError(
                    f"The engine's process exited while loading (code {self.process.exitcode}).")
        message = self._rounds.recv()
        if message[:1] == FAILED:
            raise pickle.loads(message[1:])
        assert message[:1] == READY
        if self.fronts > 1:
            with open(os.path.join(self.directory, READY_FILE), "wb") as f:
                f.write(message[1:])
        return pickle.loads(message[1:])

    def _engine_running(self) -> bool:
        return self.process.is_alive()

    async def _exited(self) -> int | None:
        await trio.lowlevel.wait_readable(self.process.sentinel)
        self.process.join()
        return self.process.exitcode

    def after_death(self) -> None:
        """The engine died: its process ends (if it has not), and with it every request's blocks."""
        if self.process is not None and self.process.is_alive():
            self.process.kill()

    def close(self) -> None:
        """Stop the engine's process (told to, then killed after JOIN_S), close the sockets.
        Idempotent; blocks while the process ends."""
        if self._closed:
            return
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
            super().close()
            shutil.rmtree(self.directory, ignore_errors=True)
