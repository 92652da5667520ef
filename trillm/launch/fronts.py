"""`--api-server-count N`: N HTTP fronts on one port, each a Trio app on Hypercorn in a process
of its own, all served by the one engine's process.

One loop frames and sends every token of every stream; where that loop is what limits the served
rate (benchmarks/README.md, the host path), more fronts share the work. The first front is
`trillm serve`'s own process: it starts the engine's process (trillm/engine/core_process.py's
EngineProcess, with a pair of sockets for each front), opens the listening sockets, and spawns the
others, which inherit them: the kernel hands each new connection to one front. A front holds its
requests' streams; the engine's process holds what they share (the queue, the KV cache, the LoRA
registry, aborts by name); each Round reaches the front whose requests it carries
(trillm/engine/front_links.py). Prometheus's counters and histograms are kept in files that every
front writes and any front's /metrics sums (prometheus_client's multiprocess mode); stored
responses, in an SQLite file every front shares (trillm/http/responses_store.py). The first front
serves once every front does.

Signals: the other fronts ignore SIGINT and SIGTERM (a terminal's Ctrl-C, or a service manager's
SIGTERM, may reach the whole group) and drain when the first front tells them (SIGUSR1, once per
signal it gets: a second one cuts their drain short as it does its own; and once as it ends, if
it ends by an error: trillm.launch.serve.serve). A front that dies stops
the server (the first front drains and exits 1); the fronts die with the first (SIGKILL).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass

import trio
from hypercorn.config import Config, Sockets

from trillm.http import logs
from trillm.http.settings import METRICS_DIR_VARIABLE, ServerSettings
from trillm.subprocesses import die_with_parent, start_process

log = logging.getLogger(__name__)
TELL = signal.SIGUSR1  # the first front to the others: a signal came (drain; a second: abort now)
KILL_GRACE_S = 2.0  # past the drain's bound, how long the first front waits for the others before killing them


def share_metrics() -> None:
    """Keep Prometheus's counters in files every front shares (a 0700 directory, removed when
    the first front closes its fronts); before prometheus_client is imported, in the first front,
    whose environment the others inherit."""
    assert "prometheus_client" not in sys.modules, "its multiprocess mode is chosen at import"
    os.environ[METRICS_DIR_VARIABLE] = tempfile.mkdtemp(prefix="trillm-metrics-")


@dataclass
class Fronts:
    """The first front's record of the others: their processes and the sockets they share."""

    sockets: Sockets
    processes: list[multiprocessing.Process]
    failed: bool = False  # one of them ended while serving
    stopping: bool = False  # they were told to stop: their ends are expected

    @classmethod
    def start(cls, settings: ServerSettings, config: Config, specs: list) -> Fronts:
        """Open the listening sockets, start a front for each of `specs` (EngineProcess.front_specs)
        and wait until each serves (blocks: seconds); RuntimeError if one ends first."""
        sockets = config.create_sockets()
        for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
            sock.listen(config.backlog)
        fronts = cls(sockets, [])
        context = multiprocessing.get_context("spawn")  # nothing of this process's threads or state comes along
        serving = []
        try:
            for spec in specs:
                serving.append(context.Event())
                process = context.Process(target=serve_front, name=f"trillm-front-{spec.index}", daemon=True,
                                          args=(settings, spec, sockets, os.getpid(), serving[-1]))
                start_process(process)
                fronts.processes.append(process)
            # Ready when every front is: /health's 200 then means the whole port serves.
            for process, event in zip(fronts.processes, serving):
                while not event.wait(0.2):
                    if not process.is_alive():
                        raise RuntimeError(f"HTTP front {process.name} exited while starting (code "
                                           f"{process.exitcode}).")
        except BaseException:
            fronts.tell()  # those that serve already drain what they took
            fronts.close(0)
            raise
        log.info("%d HTTP fronts serve the port (processes %s and this one)", len(specs) + 1,
                 ", ".join(str(p.pid) for p in fronts.processes))
        return fronts

    def tell(self) -> None:
        """Pass a signal on to the other fronts."""
        self.stopping = True
        for process in self.processes:
            if process.is_alive():
                os.kill(process.pid, TELL)

    async def watch(self) -> None:
        """If a front ends while the server serves, stop the server (this process drains, and exits 1)."""
        async with trio.open_nursery() as nursery:
            for process in self.processes:
                nursery.start_soon(self._watch_one, process)

    async def _watch_one(self, process: multiprocessing.Process) -> None:
        await trio.lowlevel.wait_readable(process.sentinel)
        process.join()
        if self.stopping:
            return
        log.error("HTTP front %s (process %d) exited (code %s): stopping the server", process.name, process.pid,
                  process.exitcode)
        self.failed = True
        os.kill(os.getpid(), signal.SIGTERM)

    def close(self, drain_timeout: float) -> None:
        """Wait for the fronts to end (they drain within `drain_timeout`, as this one does), kill
        any left, close the sockets, remove the metrics' files. Blocks."""
        for process in self.processes:
            process.join(drain_timeout + KILL_GRACE_S)
            if process.is_alive():
                log.warning("HTTP front %s did not stop: killing it", process.name)
                process.kill()
                process.join()
        for sock in (*self.sockets.secure_sockets, *self.sockets.insecure_sockets):
            sock.close()
        directory = os.environ.get(METRICS_DIR_VARIABLE)
        if directory:
            shutil.rmtree(directory, ignore_errors=True)


def serve_front(settings: ServerSettings, spec, sockets: Sockets, first_pid: int, serving) -> None:
    """A front other than the first: serve the app on its link to the engine until told to stop;
    `serving` (a multiprocessing Event) is set once it takes signals and serves."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    told = []  # a drain asked for while this front starts: taken once it listens for signals
    signal.signal(TELL, lambda *_: told.append(True))
    die_with_parent(signum=signal.SIGKILL)
    if os.getppid() != first_pid:  # the first front ended before the line above could tie us to it
        return
    logs.configure(settings.log_level, spec.index)

    def listening() -> None:
        serving.set()
        if told:
            os.kill(os.getpid(), TELL)

    trio.run(_serve_front, settings, spec, sockets, listening)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the first front does: the interpreter's teardown frees nothing the system would not


async def _serve_front(settings: ServerSettings, spec, sockets: Sockets, listening) -> None:
    from trillm.engine.api import EngineLink
    from trillm.launch.serve import hypercorn_config, serve_app

    link = await trio.to_thread.run_sync(EngineLink, spec)
    log.info("front %d serves in process %d", spec.index, os.getpid())
    try:
        await serve_app(settings, link, hypercorn_config(settings), sockets, signals=(TELL,), listening=listening)
    finally:
        await trio.to_thread.run_sync(link.close)
