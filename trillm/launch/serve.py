"""`trillm serve`: Hypercorn's trio worker, in this process, with a graceful shutdown.

On the first SIGTERM or SIGINT the engine drains: it takes no new requests (they
and /health get 503), running ones may finish, then the rest are aborted and their
streams end with finish_reason "abort" and `[DONE]`. Only then does Hypercorn close
its listeners and, after a short grace for those last chunks, its connections. The
process is gone within `drain_timeout` of the signal (an orchestrator kills it at
its own grace period, which operators set to the same number): `ShutdownBudget`
keeps the end of it for the aborts, the last chunks and closing, and the process
exits without the interpreter's teardown. A second signal cuts the drain short. The
signals are taken from the start: one that comes while the model loads (or the other fronts
start) stops the start where it is, and the process leaves at once.

The drain runs inside Hypercorn's shutdown trigger, not after it, because
Hypercorn holds idle keep-alive connections open for its whole grace period:
a grace as long as the drain would delay every exit by the full drain timeout.
"""
from __future__ import annotations

import contextlib
import enum
import gc
import logging
import os
import signal
import sys
from dataclasses import dataclass, replace

import trio
from hypercorn.config import Config

from trillm.heap import freeze_imports
from trillm.http import logs
from trillm.http.settings import ServerSettings
from trillm.model.unservable import UnservableModel

log = logging.getLogger(__name__)
FLUSH_GRACE = 3.0  # seconds after the drain for aborted streams to send their last chunk
STOP_RESERVE = 1.0  # seconds of the drain timeout kept for aborting, the last chunks and closing


@dataclass(frozen=True)
class ShutdownBudget:
    """How the seconds between a signal and `deadline` (Trio's clock) are spent: running
    requests may finish until `finish_by`; then the aborted streams' last chunks get what is
    left, less half the reserve, which closing the engine and exiting take."""

    finish_by: float
    deadline: float

    @classmethod
    def starting(cls, now: float, drain_timeout: float) -> ShutdownBudget:
        reserve = min(STOP_RESERVE, drain_timeout / 2)
        return cls(finish_by=now + drain_timeout - reserve, deadline=now + drain_timeout)

    def flush_grace(self, now: float) -> float:
        """Seconds Hypercorn may wait, from `now`, for the last chunks before closing connections."""
        reserve = self.deadline - self.finish_by
        return max(0.0, min(FLUSH_GRACE, self.deadline - reserve / 2 - now))


def hypercorn_config(settings: ServerSettings) -> Config:
    config = Config()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.backlog = settings.backlog
    config.graceful_timeout = FLUSH_GRACE
    config.loglevel = settings.log_level.upper()
    config.errorlog = "-"
    return config


async def serve(settings: ServerSettings, *, task_status=trio.TASK_STATUS_IGNORED) -> bool:
    """Load the model, then serve until a signal; `task_status` gets the bound URLs. Returns
    whether it stopped because a front failed. With
    --api-server-count N the other N - 1 fronts serve the same port from processes of their own
    (trillm.launch.fronts), told of each signal this one gets. A signal before it serves stops
    the start where it is (see _start)."""
    # Taken before anything starts: a KeyboardInterrupt raised while a worker thread loads or
    # starts the fronts would land where this task next resumes, past what it started.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
        config = hypercorn_config(settings)
        started = await _start(settings, config, received)
        if isinstance(started, Unstarted):
            return started is Unstarted.FRONT_ENDED
        core, others = started
        try:
            if others is not None:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(others.watch)
                    await serve_app(settings, core, config, others.sockets, others.tell, received=received,
                                    task_status=task_status)
                    nursery.cancel_scope.cancel()
            else:
                await serve_app(settings, core, config, received=received, task_status=task_status)
        finally:
            if others is not None:  # the engine serves them until they have drained
                if not others.stopping:  # this one ends untold (an error): they drain too
                    others.tell()
                await trio.to_thread.run_sync(others.close, settings.drain_timeout)
            await trio.to_thread.run_sync(core.close)  # the other tensor-parallel ranks stop with the server
    return others is not None and others.failed


class Unstarted(enum.Enum):
    """Why _start did not start the server."""

    SIGNALLED = enum.auto()  # a signal came first
    FRONT_ENDED = enum.auto()  # another front ended while starting (it logged why)


async def _start(settings: ServerSettings, config: Config, received) -> tuple | Unstarted:
    """(the engine, the other fronts or None), loaded and started in worker threads (the fronts
    on `config`'s sockets), taking the first signal from `received` meanwhile. On a signal the
    threads are abandoned where they are: the process leaves at once (run), and what they
    started ends with it (an engine's or a front's process dies with this one), so that a stop
    asked for while a large model loads is as quick as any other. A front that ends while
    starting: the engine is closed."""
    from trillm.engine.api import EngineCore, EngineProcess

    signalled: list[int] = []
    started = None
    async with trio.open_nursery() as nursery:

        async def stop_on_signal() -> None:
            signalled.append(await anext(received))
            nursery.cancel_scope.cancel()

        nursery.start_soon(stop_on_signal)
        log.info("loading %s", settings.engine.model or "the default model")
        count = settings.api_server_count
        if engine_process(settings):
            core = await trio.to_thread.run_sync(EngineProcess, settings.engine, count, abandon_on_cancel=True)
        else:
            core = await trio.to_thread.run_sync(EngineCore, settings.engine, abandon_on_cancel=True)
        others = None
        if count > 1:
            from trillm.launch.fronts import Fronts

            try:
                others = await trio.to_thread.run_sync(Fronts.start, settings, config, core.front_specs(),
                                                       abandon_on_cancel=True)
            except RuntimeError as exc:  # a front ended while starting: it logged why
                log.error("%s Stopping the server.", exc)
                await trio.to_thread.run_sync(core.close)
                nursery.cancel_scope.cancel()
                return Unstarted.FRONT_ENDED
        started = core, others
        nursery.cancel_scope.cancel()
    if signalled and started is not None:
        # it came as the start ended, and the watcher took it: serving takes it again, and stops
        signal.raise_signal(signalled[0])
    elif signalled:
        log.info("%s while starting: stopping", signal.Signals(signalled[0]).name)
        return Unstarted.SIGNALLED
    return started


async def serve_app(settings: ServerSettings, core, config: Config, sockets=None, on_signal=None,
                    signals=(signal.SIGTERM, signal.SIGINT), listening=None, *, received=None,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve an app on `core` under Hypercorn (on `sockets` if given, else on `config`'s bind)
    until one of `signals`, then drain (the module docstring); `on_signal()` after each one;
    `listening()` once the signals are taken (before that they do what they did). `received`:
    a receiver that took them already (one that came meanwhile stops the server at once)."""
    from hypercorn.trio.run import worker_serve
    from hypercorn.utils import wrap_app

    from trillm.http.app import create_app
    from trillm.http.state import EXTENSION

    app = create_app(settings, core)
    engine = app.extensions[EXTENSION].engine

    async def shutdown_trigger() -> None:
        signum = await anext(received)
        if on_signal is not None:
            on_signal()
        budget = ShutdownBudget.starting(trio.current_time(), settings.drain_timeout)
        log.info("%s: draining; the process stops within %g s", signal.Signals(signum).name,
                 settings.drain_timeout)
        async with trio.open_nursery() as nursery:

            async def cut_short() -> None:
                await anext(received)
                if on_signal is not None:
                    on_signal()
                log.info("second signal: aborting every request now")
                nursery.cancel_scope.cancel()

            nursery.start_soon(cut_short)
            await engine.drain(max(0.0, budget.finish_by - trio.current_time()))
            nursery.cancel_scope.cancel()
        engine.abort_all()  # a no-op after a full drain
        # Hypercorn reads its grace once this trigger returns.
        config.graceful_timeout = budget.flush_grace(trio.current_time())

    with contextlib.nullcontext(received) if received is not None else trio.open_signal_receiver(*signals) as received:
        if listening is not None:
            listening()
        await worker_serve(wrap_app(app, config.wsgi_max_body_size, None), config, sockets=sockets,
                           shutdown_trigger=shutdown_trigger, task_status=task_status)


def engine_process(settings: ServerSettings) -> bool:
    """Whether the engine runs in a process of its own: as asked, or else by its measured default."""
    from trillm.engine.api import faster_in_own_process

    if settings.api_server_count > 1:
        return True
    if settings.engine_process is not None:
        return settings.engine_process
    return faster_in_own_process(settings.engine)


def run(settings: ServerSettings) -> None:
    """Serve; or supervise data-parallel replicas behind a router (trillm.launch.data_parallel); or,
    on a rank other than 0 that a launcher (torchrun) started, be that rank's tensor-parallel
    worker (rank 0 serves HTTP for all of them). The engine (and torch) is imported only past the
    supervisor's branch: a supervisor runs no model, and its replicas import their own."""
    logs.configure(settings.log_level)
    if settings.supervises:
        from trillm.launch import data_parallel

        gc.enable()  # the command line paused it for a start-up that loads a model (trillm.heap)
        raise SystemExit(data_parallel.run(settings))
    from trillm.engine.api import launcher_init_method, launcher_rank, run_worker

    rank = launcher_rank()
    if rank:
        engine = settings.engine
        run_worker(replace(engine, tp_init_method=engine.tp_init_method or launcher_init_method()), rank)
        return
    if settings.api_server_count > 1:
        from trillm.launch.fronts import share_metrics

        share_metrics()  # before anything imports prometheus_client
    freeze_imports()  # the command line paused the collector (trillm.heap)
    try:
        failed = trio.run(serve, settings)
    except* UnservableModel as refused:
        # found while loading, where the command line's header check (loader.check_model) could
        # not see it, e.g. a vocabulary no tokenizer is built of: refused as that check refuses
        while isinstance(refused, BaseExceptionGroup):
            refused = refused.exceptions[0]
        sys.stderr.write(f"trillm serve: error: {refused}\n")
        sys.stderr.flush()
        os._exit(2)
    # Served and closed: skip the interpreter's teardown, whose full collection of what the server
    # loaded takes most of a second of the drain's bound and frees nothing the system would not.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)
