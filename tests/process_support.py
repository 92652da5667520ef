"""Which processes are alive, read from /proc: for tests that no process outlives its server; and
a server started as a user starts it, in a process of its own."""
import os
import re
import subprocess
import sys
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT = 300  # seconds: the model loads first (not a speed check)


def live(pid: int) -> bool:
    """Running or sleeping: neither gone nor a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def resident_bytes(pid: int | str = "self") -> int:
    """A process's resident set now (this one's by default)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fresh_process_output(source: str, *args: str) -> str:
    """The stdout of `source` run in a fresh interpreter, whose heap no other test has shaped,
    with these helpers and the tests' modules importable."""
    tests = os.path.dirname(__file__)
    path = os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", source, *args], cwd=tests, capture_output=True, text=True,
                          check=True, env={**os.environ, "PYTHONPATH": path})
    return done.stdout


ARENA_BYTES = 64 << 20  # glibc's HEAP_MAX_SIZE on 64 bits: a thread's arena reserves this much, aligned


def thread_arenas(pid: int | str = "self") -> int:
    """How many malloc arenas other than the main one a process holds: glibc maps each as an
    anonymous reservation of ARENA_BYTES at an address aligned to it, readable and writable as
    far as it is used, the rest inaccessible."""
    spans = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) == 5:  # no path: anonymous
                start, end = (int(a, 16) for a in fields[0].split("-"))
                spans.append((start, end, fields[1]))
    arenas = 0
    for i, (start, end, mode) in enumerate(spans):
        if start % ARENA_BYTES or mode != "rw-p":
            continue
        reserved = spans[i + 1] if i + 1 < len(spans) else None
        if end == start + ARENA_BYTES or (reserved is not None and reserved[0] == end and reserved[2] == "---p"
                                           and reserved[1] == start + ARENA_BYTES):
            arenas += 1
    return arenas


def children(pid: int) -> set[int]:
    """The live children of `pid`, whichever of its threads started them."""
    found = set()
    for task in os.listdir(f"/proc/{pid}/task") if live(pid) else []:
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found |= {int(p) for p in f.read().split()}
    return {p for p in found if live(p)}


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        kids = children(todo.pop()) - found
        found |= kids
        todo += kids
    return found


def multiprocessing_helper(pid: int) -> bool:
    """Whether `pid` is multiprocessing's fork server (trillm.subprocesses.start_preloaded's) or
    its resource tracker: each lives as long as the process that started it."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
    except FileNotFoundError:
        return False
    return b"multiprocessing.forkserver" in command or b"multiprocessing.resource_tracker" in command


def started_by(pid: int) -> set[int]:
    """The live processes `pid` started, directly or through multiprocessing's helpers (its own
    children, not counted themselves; what the fork server forks shares its command line)."""
    helpers = {p for p in children(pid) if multiprocessing_helper(p)}
    return {p for p in descendants(pid) - helpers if live(p)}


async def start_server(nursery: trio.Nursery, command: list[str], env=None, cwd=REPO
                       ) -> tuple[trio.Process, str, list[str]]:
    """The process, its URL (read from its log: it binds port 0), and its log lines so far and to come."""
    process = await nursery.start(
        lambda task_status: trio.run_process(
            command, cwd=cwd, env=env, stderr=subprocess.STDOUT, stdout=subprocess.PIPE, check=False,
            task_status=task_status,
        )
    )
    log: list[str] = []
    url = trio.Event()
    found = []

    async def read_log():
        buffer = b""
        async for data in process.stdout:
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                log.append(line.decode(errors="replace"))
                match = re.search(r"Running on (http://[\d.]+:\d+)", log[-1])
                if match and not url.is_set():
                    found.append(match.group(1))
                    url.set()

    nursery.start_soon(read_log)
    with trio.fail_after(STARTUP_TIMEOUT):
        await url.wait()
    return process, found[0], log


async def logged(log: list[str], text: str, timeout: float = STARTUP_TIMEOUT) -> None:
    """Wait until a line of `log` says `text`; on timeout, fail with the log's tail (the
    default bound is a start's: processes import and load before they say most things)."""
    with trio.move_on_after(timeout):
        while not any(text in line for line in log):
            await trio.sleep(0.002)
        return
    raise AssertionError(f"no line says {text!r} after {timeout} s:\n" + "\n".join(log[-40:]))
