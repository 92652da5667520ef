"""The children trillm starts (tensor-parallel ranks, data-parallel replicas and their router, the
grammar compiler) die with the server's process, and only then: not with the thread that
happened to start them (PR_SET_PDEATHSIG follows the forking thread, and Trio's worker threads
end after 10 s idle)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from process_support import live

from trillm.subprocesses import spawn


def test_a_child_outlives_the_thread_that_started_it():
    started = []
    thread = threading.Thread(target=lambda: started.append(spawn(["sleep", "30"])))
    thread.start()
    thread.join()
    (child,) = started
    try:
        time.sleep(0.5)
        assert child.poll() is None, "the child died with the thread that started it"
    finally:
        child.kill()
        child.wait()


def test_a_child_dies_with_its_process():
    parent = subprocess.Popen([sys.executable, "-c", "import sys, threading, time\n"
                               "from trillm.subprocesses import spawn\n"
                               "child = []\n"
                               "t = threading.Thread(target=lambda: child.append(spawn(['sleep', '30'])))\n"
                               "t.start(); t.join()\n"
                               "print(child[0].pid, flush=True)\n"
                               "time.sleep(30)\n"], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert live(child)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while live(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live(child), "the child outlived its process"


CHAIN = '''
import multiprocessing, time
from trillm.subprocesses import start_preloaded

def grandchild():
    time.sleep(60)

def child(report):  # a data-parallel replica with tensor parallelism: it starts its ranks
    report.send(start_preloaded(grandchild, preload=()).pid)
    time.sleep(60)

if __name__ == "__main__":
    reader, writer = multiprocessing.Pipe(duplex=False)
    process = start_preloaded(child, writer, preload=(), daemon=False)
    print(process.pid, reader.recv(), flush=True)
    time.sleep(60)
'''


def test_a_preloaded_child_starts_its_own_and_both_die_with_the_process(tmp_path):
    """A child of the fork server that is no daemon starts preloaded children of its own (a
    replica its ranks), and the whole chain ends when the process is killed."""
    script = tmp_path / "chain.py"
    script.write_text(CHAIN)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(map(live, pids)), "the child could not start one of its own"
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while any(map(live, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(live, pids)), "a child outlived its process"
