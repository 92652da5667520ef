"""`trillm serve`: Hypercorn's trio worker, in this process, with a graceful shutdown.

On the first SIGTERM or SIGINT, Hypercorn stops accepting connections and the
engine drains: running requests may finish for `drain_timeout` seconds, then the
rest are aborted, and their streams end with finish_reason "abort" and
`[DONE]`. Hypercorn's own grace period is a little longer than the drain, so
those last chunks reach their clients before it cancels what is left.
"""
from __future__ import annotations

import logging
import signal

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from trillm.engine.core import EngineCore
from trillm.http.app import create_app
from trillm.http.settings import ServerSettings
from trillm.http.state import EXTENSION

log = logging.getLogger(__name__)
FLUSH_GRACE = 5.0  # seconds past the drain for aborted streams to send their last chunk


def hypercorn_config(settings: ServerSettings) -> Config:
    config = Config()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.graceful_timeout = settings.drain_timeout + FLUSH_GRACE
    config.loglevel = settings.log_level.upper()
    config.errorlog = "-"
    return config


async def serve(settings: ServerSettings, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Load the model, then serve until a signal; `task_status` gets the bound URLs."""
    log.info("loading %s", settings.engine.model or "the default model")
    core = await trio.to_thread.run_sync(EngineCore, settings.engine)
    app = create_app(settings, core)

    async def shutdown_trigger() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("%s: draining for up to %.0f s", signal.Signals(signum).name, settings.drain_timeout)
                break
        app.nursery.start_soon(app.extensions[EXTENSION].engine.drain, settings.drain_timeout)

    await hypercorn_serve(app, hypercorn_config(settings), shutdown_trigger=shutdown_trigger, task_status=task_status)


def run(settings: ServerSettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    trio.run(serve, settings)
