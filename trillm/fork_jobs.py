"""Jobs that each run in a process forked for them, killed when their time is up and held under
a memory limit.

Some work cannot be stopped or bounded inside the server: xgrammar compiles in C++ that no
Python thread can interrupt (a schema that takes a minute holds a core for that minute, long
after its request was refused), and a chat template a request brought is code that may loop
or allocate without end. Such a job runs in a fork, which is killed at its deadline and whose
address space is capped, so the server's memory and cores are never its to take.

The forks come from a worker process (`python -m trillm.fork_jobs HANDLER FD...`), not from the
server: the server runs many threads (torch's, the engine's, Trio's) and a fork copies the locks
they hold but not the threads, while the worker holds the handler's state and little else. So a
job starts in a fork's time, and a kill costs no restart. A handler is a module with
`setup(payload: bytes) -> state`, run once in the worker, and `run(state, job: dict) -> dict`,
run in each fork. The worker has a fixed number of slots, each a pair of pipes, one job at a
time on each; it waits on all of them and on its forks at once (multiprocessing.connection.wait).

On each slot, in multiprocessing.connection's framing:
  server -> worker  (slot 0 only, once) the handler's setup payload;
  worker -> server  (slot 0 only, once) {"ready": true};
  server -> worker  {"job": {...}, "timeout": seconds, "memory": bytes (0: no limit)}, JSON;
  worker -> server  the handler's reply | {"timeout": true} | {"memory": true} | {"crashed": true}.
"""
from __future__ import annotations

import importlib
import json
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from trillm.subprocesses import die_with_parent, spawn

START_TIMEOUT_S = 120.0  # a handler's imports (xgrammar brings torch) on a busy machine
REPLY_GRACE_S = 5.0  # beyond a job's timeout, for the worker to stop the fork and answer
CLOSE_CHECK_S = 0.5  # how often a wait for an answer looks whether the worker was closed


class JobTimeout(Exception):
    """The job ran past its time and was stopped."""


class JobOutOfMemory(Exception):
    """The job asked for more memory than its limit and was stopped."""


class WorkerClosed(RuntimeError):
    """The worker was closed by its owner while the job waited or ran."""


@dataclass
class _Slot:
    """The server's ends of one slot's pipes."""

    replies: Connection
    requests: Connection

    def close(self) -> None:
        self.requests.close()
        self.replies.close()


class ForkWorker:
    """One worker process for the handler module `handler`, with `slots` jobs at once. The
    constructor starts it, hands it `setup`, and waits until it is ready (RuntimeError naming
    `name` if it is not within START_TIMEOUT_S). It dies with the server.

    Thread-safe: `run` takes a free slot (waiting for one while all are busy). If the worker
    fails, it is killed and `alive` turns False; the jobs in flight then fail too. `close()` kills
    it (idempotent; jobs in flight raise WorkerClosed); the object is a context manager."""

    def __init__(self, handler: str, setup: bytes, slots: int, name: str):
        assert slots >= 1
        self.name = name
        server_ends, worker_fds = [], []
        for _ in range(slots):
            reply_read, reply_write = os.pipe()
            request_read, request_write = os.pipe()
            server_ends.append(_Slot(Connection(reply_read, writable=False), Connection(request_write, readable=False)))
            worker_fds += [request_read, reply_write]
        try:
            self._process = spawn([sys.executable, "-m", __name__, handler, *map(str, worker_fds)],
                                  pass_fds=worker_fds, stdin=subprocess.DEVNULL)
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
            first.requests.send_bytes(setup)
            if self._reply(first, START_TIMEOUT_S) != {"ready": True}:
                raise RuntimeError("it answered something else")
        except (OSError, EOFError, RuntimeError) as exc:
            self.close()
            raise RuntimeError(f"the {name} process did not start: {exc}") from None

    @property
    def alive(self) -> bool:
        return not self.closed and self._process.poll() is None

    def run(self, job: dict, timeout: float, memory: int = 0) -> dict:
        """The handler's reply to `job`, run in a fork for at most `timeout` seconds and, given
        `memory`, with at most that many bytes more address space than the worker holds. Raises
        JobTimeout or JobOutOfMemory (the fork was stopped), WorkerClosed if the worker was
        closed, RuntimeError if the worker failed or the fork died without answering. Blocks
        until a slot is free, then for at most `timeout` + REPLY_GRACE_S."""
        slot = self._take_slot()
        try:
            slot.requests.send_bytes(json.dumps({"job": job, "timeout": timeout, "memory": memory}).encode())
            reply = self._reply(slot, timeout + REPLY_GRACE_S)
        except (OSError, EOFError, RuntimeError) as exc:
            if self.closed:
                raise WorkerClosed(f"the {self.name} process was closed") from None
            self.close()  # it no longer answers as it should: none of its slots is trusted
            raise RuntimeError(f"the {self.name} process failed: {exc}") from None
        finally:
            self._free.put(slot)
            if self.closed:
                self._close_free_slots()
        if reply.get("timeout") is True:
            raise JobTimeout
        if reply.get("memory") is True:
            raise JobOutOfMemory
        if reply.get("crashed") is True:
            raise RuntimeError(f"the {self.name} crashed on this job")
        return reply

    def _reply(self, slot: _Slot, timeout: float) -> dict:
        """The next message on `slot`. Looks every CLOSE_CHECK_S whether the worker was closed or
        exited: a process forked from this one meanwhile (multiprocessing forks keep every
        descriptor) may hold the worker's end of the pipe open, so no end-of-file need come."""
        deadline = time.monotonic() + timeout
        while not slot.replies.poll(min(CLOSE_CHECK_S, max(0.0, deadline - time.monotonic()))):
            if self.closed:
                raise WorkerClosed(f"the {self.name} process was closed")
            if self._process.poll() is not None:
                raise RuntimeError(f"it exited with status {self._process.returncode}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"no answer within {timeout:g} s")
        return json.loads(slot.replies.recv_bytes())

    def _take_slot(self) -> _Slot:
        while not self.closed:
            try:
                return self._free.get(timeout=1.0)
            except queue.Empty:
                pass
        raise WorkerClosed(f"the {self.name} process was closed")

    def close(self) -> None:
        self.closed = True
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._close_free_slots()  # a busy slot's job closes it when it returns

    def _close_free_slots(self) -> None:
        while True:
            try:
                self._free.get_nowait().close()
            except queue.Empty:
                return

    def __enter__(self) -> ForkWorker:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class WorkerOnDemand:
    """A worker started on first use, and again after one failed or was closed. Thread-safe
    (one start at a time); `close()` stops the current one (idempotent; a later `get` starts
    another); a context manager."""

    def __init__(self):
        self._worker: ForkWorker | None = None
        self._lock = threading.Lock()

    def get(self, start: Callable[[], ForkWorker]) -> ForkWorker:
        """The running worker, or the one `start` makes now if there is none alive."""
        with self._lock:
            if self._worker is None or not self._worker.alive:
                self._worker = start()
            return self._worker

    def close(self) -> None:
        with self._lock:
            if self._worker is not None:
                self._worker.close()

    def __enter__(self) -> WorkerOnDemand:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


@dataclass
class _Fork:
    """A job in flight in the worker: the forked process, where its answer goes, and until when."""

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


def _address_space() -> int:
    """This process's virtual size in bytes (what RLIMIT_AS counts)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _fork_job(handler, state, request: dict, reply_to: Connection) -> _Fork:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the fork: run the job, answer, and leave without running the worker's cleanup
        status = 0
        try:
            die_with_parent()  # the worker may be killed while its forks run
            os.close(read_fd)
            if request["memory"]:
                limit = _address_space() + request["memory"]
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            try:
                reply = handler.run(state, request["job"])
            except MemoryError:
                reply = {"memory": True}
            Connection(write_fd, readable=False).send_bytes(json.dumps(reply).encode())
        except BaseException:
            status = 1
        finally:
            os._exit(status)
    os.close(write_fd)
    return _Fork(pid, Connection(read_fd, writable=False), reply_to, time.monotonic() + request["timeout"])


def _worker(handler_name: str, fds: list[int]) -> None:
    """The worker's loop: jobs in on every slot, one fork per job, each fork's answer (or its
    timeout) back on its slot. Ends when the server closes the slots."""
    slots = {Connection(fds[i], writable=False): Connection(fds[i + 1], readable=False)
             for i in range(0, len(fds), 2)}
    first = next(iter(slots))
    # Python warns on a fork beside other threads; the ones here (torch's, idle) hold nothing
    # a job takes, and the fork runs only the job.
    warnings.filterwarnings("ignore", message=".*multi-threaded.*fork", category=DeprecationWarning)
    handler = importlib.import_module(handler_name)
    state = handler.setup(first.recv_bytes())
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
            fork = _fork_job(handler, state, request, slots[conn])
            forks[fork.result] = fork
        now = time.monotonic()
        for conn, fork in list(forks.items()):
            if fork.deadline <= now:
                del forks[conn]
                fork.end(None)


if __name__ == "__main__":
    _worker(sys.argv[1], [int(fd) for fd in sys.argv[2:]])
