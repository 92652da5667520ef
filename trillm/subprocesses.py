"""What the processes trillm starts itself share (tensor-parallel ranks, data-parallel replicas
and their router, the workers of forked jobs): a free loopback port to meet at, an even share of the
cores, and a death tied to their parent's, so that no child outlives the server however it ends."""
from __future__ import annotations

import ctypes
import importlib
import multiprocessing
import os
import signal
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor

_PR_SET_PDEATHSIG = 1


def even_span(n: int, index: int, count: int) -> tuple[int, int]:
    """Part `index`'s [start, end) of n things split in `count` parts as evenly as can be (the
    first n % count parts take one more)."""
    base, extra = divmod(n, count)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def cpu_share(index: int, count: int) -> set[int]:
    """Part `index`'s even share of the cores this process may run on (all of them when there
    are fewer cores than parts)."""
    cores = sorted(os.sched_getaffinity(0))
    start, end = even_span(len(cores), index, count)
    return set(cores[start:end]) or set(cores)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The kernel sends PR_SET_PDEATHSIG when the *thread* that forked the child ends, not its
# process: a child started from a worker thread (Trio's end after 10 s idle) would be killed
# with it. Children are forked from this one thread, which lives as long as the process.
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trillm-spawner")


def spawn(command: list[str], cpus: set[int] | None = None, **popen_args) -> subprocess.Popen:
    """Start `command` as a child that dies with this process (die_with_parent), on `cpus` if
    given, whichever thread calls this. `popen_args` go to subprocess.Popen."""
    return _spawner.submit(subprocess.Popen, command, preexec_fn=lambda: die_with_parent(cpus), **popen_args).result()


def start_process(process: multiprocessing.process.BaseProcess) -> None:
    """`process.start()` from the one long-lived thread (above), so that the parent-death signal
    it sets for itself (die_with_parent) follows the process, whichever thread calls this."""
    _spawner.submit(process.start).result()


# What a preloaded child finds imported (start_preloaded): for a tensor-parallel rank, the model
# side, torch with it, and the Llama family's config, whose import brings most of what reading any
# model's config imports (transformers loads it lazily, on the first AutoConfig, which every rank
# makes); for a data-parallel replica, the server around them too.
MODEL_SIDE = ("trillm.model.runner", "transformers.models.llama.configuration_llama")
SERVER = (*MODEL_SIDE, "trillm.engine.api", "trillm.http.app", "trillm.launch.serve")


def start_preloaded(target, *args, preload: tuple[str, ...] = MODEL_SIDE, daemon: bool = True,
                    cpus: set[int] | None = None) -> multiprocessing.Process:
    """Run `target(*args)` in a child forked from multiprocessing's fork server, which imported
    `preload` once: the child starts in a fork's time rather than an interpreter's imports, and
    every later child of this process forks from the same server. One fork server per process:
    it is started, single-threaded, by the first call, with that call's `preload` (a process
    starts one kind of child: ranks, or replicas), and sees this process's environment as it
    was then. It exits when this process does, and its children die with it (die_with_parent).
    A daemon child also stops when this process ends; a child that starts processes of its own
    (a replica's ranks) must not be one. `cpus`, if given, are the only cores the child runs on.
    `target` and `args` must pickle."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    process = context.Process(target=_preloaded_child, args=(cpus, target, *args), daemon=daemon)
    process.start()
    return process


def call_preloaded(target: str, *args, preload: tuple[str, ...] = MODEL_SIDE):
    """`target` ("module:function") called with `args` in a child forked from the fork server
    (start_preloaded): its result here, or here what it raised. For work that needs the preloaded
    modules in a process that should not import them itself: a data-parallel supervisor, which
    runs no model, checking the one its replicas will fork to load. Named, not passed, so that
    this process need not import it. Blocks until the child has answered and ended."""
    reader, writer = multiprocessing.get_context("forkserver").Pipe(duplex=False)
    process = start_preloaded(_call_and_send, writer, target, *args, preload=preload)
    writer.close()  # the child's copy alone: an end without an answer reads as EOF
    try:
        succeeded, value = reader.recv()
    except EOFError:
        raise ChildProcessError(f"{target} ended its process without an answer.") from None
    finally:
        reader.close()
        process.join()
    if not succeeded:
        raise value
    return value


def _call_and_send(writer, target: str, *args) -> None:
    module, _, name = target.partition(":")
    try:
        answer = (True, getattr(importlib.import_module(module), name)(*args))
    except Exception as exc:  # sent back to be raised there
        answer = (False, exc)
    writer.send(answer)
    writer.close()


def _preloaded_child(cpus: set[int] | None, target, *args) -> None:
    die_with_parent(cpus)
    _release_the_fork_server()
    target(*args)


def _release_the_fork_server() -> None:
    """Close, in a child of the fork server, its copy of the pipe end by which the server learns
    that the process that started it has ended. multiprocessing hands it to every child (so that
    a child could start siblings through the same server; trillm's start a server of their own
    if they start any). Held open, it keeps the server waiting for that end while the child
    lives, and the child, which dies with the server, lives while the server does: killed with
    SIGKILL, the process would leave both behind."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # CPython's one client state; the fd is the only handle to that end
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def die_with_parent(cpus: set[int] | None = None, signum: int = signal.SIGTERM) -> None:
    """For a child, before it runs anything else (a preexec_fn, before exec; or the first call
    of a forked child): the kernel sends the child `signum` when its parent exits; `cpus`, if
    given, are the only cores it runs on."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    if cpus:
        os.sched_setaffinity(0, cpus)
