"""What the processes trillm starts itself share (tensor-parallel ranks, data-parallel replicas
and their router, the grammar compiler): a free loopback port to meet at, an even share of the
cores, and a death tied to their parent's, so that no child outlives the server however it ends."""
from __future__ import annotations

import ctypes
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


# The modules a preloaded child finds imported (start_preloaded): the model side, torch with it,
# and the Llama family's config, whose import brings most of what reading any model's config
# imports (transformers loads it lazily, on the first AutoConfig, which every rank makes).
PRELOADED = ["trillm.model.runner", "transformers.models.llama.configuration_llama"]


def start_preloaded(target, *args) -> multiprocessing.Process:
    """Run `target(*args)` in a child forked from multiprocessing's fork server, which imported
    PRELOADED once: the child starts in a fork's time rather than an interpreter's imports, and
    every later child of this process (the ranks of a later engine too) forks from the same one.
    The fork server is started, single-threaded, by the first call, and sees this process's
    environment as it was then. It exits when this process does, and its children die with it
    (die_with_parent); they are daemons, so that this process ending stops them too. `target`
    and `args` must pickle."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    process = context.Process(target=_preloaded_child, args=(target, *args), daemon=True)
    process.start()
    return process


def _preloaded_child(target, *args) -> None:
    die_with_parent()
    target(*args)


def die_with_parent(cpus: set[int] | None = None) -> None:
    """For a child, before it runs anything else (a preexec_fn, before exec; or the first call
    of a forked child): the kernel sends the child SIGTERM when its parent exits; `cpus`, if
    given, are the only cores it runs on."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if cpus:
        os.sched_setaffinity(0, cpus)
