"""The engine's own process (`serve_core`, spawned by trillm/engine/core_process.py's EngineProcess).

A plain loop: it waits for commands while it has nothing to step, takes every queued one between
two steps, and runs the same trips as the server's StepThread (trillm/engine/rounds.py), sending
one Round per trip (trillm/engine/wire.py). A Call the core lets run beside its steps (a weight
update's load, seconds long) runs in a thread of its own, which replies on a socket of its own.
It ignores SIGINT and SIGTERM (the server decides when it stops, after a drain that needs it
stepping) and is killed when the server ends (trillm.subprocesses.die_with_parent). A step's error
is sent, and the process ends.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
from dataclasses import replace

import zmq

from trillm.config import EngineArgs
from trillm.engine.core import EngineCore
from trillm.engine.rounds import CALLS, Call, Command, Round, RoundRunner, trips
from trillm.engine.wire import FAILED, READY, STOP, Ready, opaque, pickled, round_encoder
from trillm.model.lora import LoRAAdapter
from trillm.subprocesses import die_with_parent

LINGER_MS = 5000  # how long a closing socket may still try to deliver (the last Round, a reply)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [engine] %(message)s"


def serve_core(args: EngineArgs, commands_address: str, rounds_address: str, server_pid: int, log_level: int) -> None:
    """The engine's process: load, say so, then apply commands and step until told to stop (or a
    step fails). It logs at the server's level, its lines marked."""
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
            rounds.send(FAILED + pickled(exc))
            return
        with core:
            adapters = [] if core.loras is None else [_record(a) for a in core.loras.adapters.values()]
            rounds.send(READY + pickle.dumps(Ready(core.config, core.args, core.tokenizer, core.stats(), adapters)))
            runner = RoundRunner(core)
            encoder = round_encoder()
            while (received := _receive(commands, wait=not core.has_unfinished())) is not None:
                for call in [c for c in received if isinstance(c, Call) and c.beside]:
                    threading.Thread(target=_call_beside, args=(core, call, context, rounds_address), daemon=True,
                                     name=f"trillm-{call.method}").start()
                for trip in trips([c for c in received if not (isinstance(c, Call) and c.beside)]):
                    done = runner.run(*trip)
                    done.replies = [(call_id, opaque(_record(reply))) for call_id, reply in done.replies]
                    rounds.send(encoder.encode(done), copy=False)
                    if done.error is not None:
                        return
    finally:
        context.destroy(linger=LINGER_MS)


def _record(value):
    """What crosses to the server of a value the core returns: a LoRA adapter's record, not its weights."""
    return replace(value, weights=None) if isinstance(value, LoRAAdapter) else value


def _call_beside(core: EngineCore, call: Call, context: zmq.Context, rounds_address: str) -> None:
    """A Call the core lets run while it steps (Call.beside), in this thread; its reply goes on a
    socket of its own (ZeroMQ's sockets belong to one thread each), in a Round of its own."""
    assert call.method in CALLS, call.method
    try:
        reply = _record(getattr(core, call.method)(*call.args))
    except Exception as exc:  # noqa: BLE001 - the caller's error, not the engine's death
        reply = exc
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.connect(rounds_address)
    try:
        sock.send(round_encoder().encode(Round(admissions=[], outputs=[], replies=[(call.call_id, opaque(reply))])))
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
