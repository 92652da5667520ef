"""EngineProcess: the engine core in a process of its own, and the server's link to it.

Why: in one process the step's thread and the event loop take the interpreter's lock in turn, so
a step waits for every token's send before it, and the served rate falls far below the engine's
own wherever the step is short (a GPU; a small model). In its own process (trillm/engine/
engine_main.py) the core steps while the server's loop frames and sends; each Round
(trillm/engine/rounds.py: every request's new tokens of one trip) crosses as one message.

The link: two ZeroMQ PUSH/PULL pairs over IPC sockets in a private directory (0700), which the
server binds and the engine's process connects to; what crosses them: trillm/engine/wire.py.

Ownership: the server's Trio thread alone submits and runs the link; the constructor and
`close` block (run them in a worker thread, or before the loop starts). `close()` is idempotent.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable

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
from trillm.model.lora import LoRARegistry
from trillm.pooling_params import PoolingParams
from trillm.sampling_params import SamplingParams
from trillm.subprocesses import start_process

log = logging.getLogger(__name__)
JOIN_S = 10.0  # how long `close` waits for the engine's process to end before it kills it
EXIT_GRACE_S = 0.5  # once the engine's process has ended, how long what it sent last may take to arrive


def faster_in_own_process(args: EngineArgs) -> bool:
    """Whether an engine serves by default in a process of its own: on a GPU, whose steps are
    short enough that in one process they wait on the loop's sends (benchmarks/README.md, the host
    path). On a CPU it serves the default model 4-24% faster there too, but the server's process
    alone (its tokenizer comes through transformers, which imports torch) holds more than the
    in-place memory bound of serving a small file leaves: opt-in there."""
    return resolve_device(args.device).type == "cuda"


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
        self._decoder = round_decoder()
        self.process = None
        self.grammars: Grammars | None = None
        try:
            # Spawned, not forked: nothing of the server's threads or state comes along, and no fork
            # server stays resident beside the two processes.
            self.process = multiprocessing.get_context("spawn").Process(
                target=serve_core, name="trillm-engine", daemon=args.tensor_parallel_size == 1,
                args=(args, commands_address, rounds_address, os.getpid(), logging.getLogger().getEffectiveLevel()))
            start_process(self.process)
            ready = self._wait_ready()
        except BaseException:
            self.close()
            raise
        self.config, self.args, self.tokenizer, self._stats = ready.config, ready.args, ready.tokenizer, ready.stats
        # The adapters requests may name, as the engine's process last said (its registry is the
        # truth: it refuses what this copy let through); their records only, never their weights.
        self.loras: LoRARegistry | None = None
        if self.args.enable_lora:
            self.loras = LoRARegistry(self.config.hf_config, self.args.max_lora_rank, 1)  # holds no weights
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
