"""`trillm serve`: Hypercorn's trio worker, in this process, with a graceful shutdown.

On the first SIGTERM or SIGINT the engine drains: it takes no new requests (they
and /health get 503), running ones may finish for up to `drain_timeout` seconds,
then the rest are aborted and their streams end with finish_reason "abort" and
`[DONE]`. Only then does Hypercorn close its listeners and, after a short grace
for those last chunks, its connections. A second signal cuts the drain short.

The drain runs inside Hypercorn's shutdown trigger, not after it, because
Hypercorn holds idle keep-alive connections open for its whole grace period:
a grace as long as the drain would delay every exit by the full drain timeout.
"""
from __future__ import annotations

import logging
import signal
from dataclasses import replace

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from trillm.http import logs
from trillm.http.settings import ServerSettings

log = logging.getLogger(__name__)
FLUSH_GRACE = 3.0  # seconds after the drain for aborted streams to send their last chunk


def hypercorn_config(settings: ServerSettings) -> Config:
    config = Config()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.backlog = settings.backlog
    config.graceful_timeout = FLUSH_GRACE
    config.loglevel = settings.log_level.upper()
    config.errorlog = "-"
    return config


async def serve(settings: ServerSettings, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Load the model, then serve until a signal; `task_status` gets the bound URLs."""
    from trillm.engine.api import EngineCore
    from trillm.http.app import create_app
    from trillm.http.state import EXTENSION

    log.info("loading %s", settings.engine.model or "the default model")
    core = await trio.to_thread.run_sync(EngineCore, settings.engine)
    app = create_app(settings, core)
    engine = app.extensions[EXTENSION].engine

    async def shutdown_trigger() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            signum = await anext(signals)
            log.info("%s: draining for up to %.0f s", signal.Signals(signum).name, settings.drain_timeout)
            async with trio.open_nursery() as nursery:

                async def cut_short() -> None:
                    await anext(signals)
                    log.info("second signal: aborting every request now")
                    nursery.cancel_scope.cancel()

                nursery.start_soon(cut_short)
                await engine.drain(settings.drain_timeout)
                nursery.cancel_scope.cancel()
        engine.abort_all()  # a no-op after a full drain

    try:
        await hypercorn_serve(app, hypercorn_config(settings), shutdown_trigger=shutdown_trigger,
                              task_status=task_status)
    finally:
        await trio.to_thread.run_sync(core.close)  # the other tensor-parallel ranks stop with the server


def run(settings: ServerSettings) -> None:
    """Serve; or supervise data-parallel replicas behind a router (trillm.http.data_parallel); or,
    on a rank other than 0 that a launcher (torchrun) started, be that rank's tensor-parallel
    worker (rank 0 serves HTTP for all of them). The engine (and torch) is imported only past the
    supervisor's branch: a supervisor runs no model, and its replicas import their own."""
    logs.configure(settings.log_level)
    if settings.supervises:
        from trillm.http import data_parallel

        raise SystemExit(data_parallel.run(settings))
    from trillm.engine.api import launcher_init_method, launcher_rank, run_worker

    rank = launcher_rank()
    if rank:
        engine = settings.engine
        run_worker(replace(engine, tp_init_method=engine.tp_init_method or launcher_init_method()), rank)
        return
    trio.run(serve, settings)
