"""The engine's own process (`serve_core`, spawned by trillm/engine/core_process.py's EngineProcess).

A plain loop: it waits for commands while it has nothing to step, takes every queued one between
two steps, and runs the same trips as the server's StepThread (trillm/engine/rounds.py), sending
each front its part of every trip's Round (trillm/engine/wire.py, trillm/engine/front_links.py).
A Call the core lets run beside its steps (a weight update's load, seconds long) runs in a thread
of its own, which replies on a socket of its own.
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
from trillm.engine.front_links import LINGER_MS, FrontLinks, replied
from trillm.engine.rounds import CALLS, Call, RoundRunner, trips
from trillm.engine.wire import FAILED, READY, Ready, opaque, pickled
from trillm.model.lora import LoRAAdapter
from trillm.subprocesses import die_with_parent

LORA_CALLS = frozenset({"load_lora", "unload_lora"})  # the calls that change what every front may name
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [engine] %(message)s"


def serve_core(args: EngineArgs, fronts: list[tuple[str, str]], server_pid: int, log_level: int) -> None:
    """The engine's process: load, say so, then apply commands and step until told to stop (or a
    step fails). `fronts`: each front's (commands, rounds) addresses, the server's first
    (trillm/engine/front_links.py). It logs at the server's level, its lines marked."""
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
    links = FrontLinks(context, fronts)
    try:
        try:
            core = EngineCore(args)
        except BaseException as exc:
            links.send_first(FAILED + pickled(exc))
            return
        with core:
            links.send_first(READY + pickle.dumps(Ready(core.config, core.args, core.tokenizer, core.stats(),
                                                        _adapters(core))))
            runner = RoundRunner(core)
            while (commands := links.receive(wait=not core.has_unfinished())) is not None:
                for call in [c for c in commands if isinstance(c, Call) and c.beside]:
                    reply_to = links.reply_address(call.call_id)
                    threading.Thread(target=_call_beside, args=(core, call, context, *reply_to), daemon=True,
                                     name=f"trillm-{call.method}").start()
                for trip in trips([c for c in commands if not (isinstance(c, Call) and c.beside)]):
                    done = runner.run(*trip)
                    done.replies = [(call_id, opaque(_record(reply))) for call_id, reply in done.replies]
                    if any(isinstance(c, Call) and c.method in LORA_CALLS for c in trip[0]):
                        done.adapters = opaque(_adapters(core))  # for the fronts that did not ask
                    links.send(done, runner, idle=not core.has_unfinished())
                    if done.error is not None:
                        return
    finally:
        links.close()
        context.destroy(linger=LINGER_MS)  # what a thread beside the steps still sends


def _adapters(core: EngineCore) -> list[LoRAAdapter]:
    return [] if core.loras is None else [_record(a) for a in core.loras.adapters.values()]


def _record(value):
    """What crosses to the server of a value the core returns: a LoRA adapter's record, not its weights."""
    return replace(value, weights=None) if isinstance(value, LoRAAdapter) else value


def _call_beside(core: EngineCore, call: Call, context: zmq.Context, rounds_address: str, call_id: int) -> None:
    """A Call the core lets run while it steps (Call.beside), in this thread; its reply goes, under
    its front's `call_id`, on a socket of its own (ZeroMQ's sockets belong to one thread each), in
    a Round of its own."""
    assert call.method in CALLS, call.method
    try:
        reply = _record(getattr(core, call.method)(*call.args))
    except Exception as exc:  # noqa: BLE001 - the caller's error, not the engine's death
        reply = exc
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.connect(rounds_address)
    try:
        sock.send(replied(call_id, opaque(reply)))
    finally:
        sock.close()
