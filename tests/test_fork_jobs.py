"""Jobs in forks of a worker process: answered, stopped at their deadline, held to their memory,
their crashes reported, and none of it taking the worker down."""
import os
import signal
import threading
import time

import pytest
from process_support import children

from trillm.fork_jobs import ForkWorker, JobOutOfMemory, JobTimeout, WorkerClosed
from trillm.subprocesses import spawn


@pytest.fixture
def worker(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(__file__))
    with ForkWorker("fork_job_handler", b"ready state", 2, "test worker") as worker:
        yield worker


def test_each_job_runs_in_a_fork_of_the_worker_that_holds_the_setup(worker):
    first = worker.run({"do": "answer"}, timeout=10)
    second = worker.run({"do": "answer"}, timeout=10)
    assert first["state"] == second["state"] == "ready state"
    assert first["pid"] != second["pid"], "a fork per job"


def test_a_job_past_its_time_is_killed_and_the_worker_serves_on(worker):
    with pytest.raises(JobTimeout):
        worker.run({"do": "sleep", "seconds": 60}, timeout=0.2)
    assert children(worker._process.pid) == set(), "the fork is gone"
    assert worker.run({"do": "answer"}, timeout=10)["state"] == "ready state"


def test_a_job_past_its_memory_is_stopped_and_one_within_it_runs(worker):
    with pytest.raises(JobOutOfMemory):
        worker.run({"do": "allocate", "bytes": 512 << 20}, timeout=30, memory=64 << 20)
    assert worker.run({"do": "allocate", "bytes": 16 << 20}, timeout=30, memory=64 << 20)["state"] == "ready state"
    assert worker.run({"do": "allocate", "bytes": 512 << 20}, timeout=30)["state"] == "ready state", "no limit asked"


def test_a_crashed_job_fails_alone(worker):
    with pytest.raises(RuntimeError, match="crashed"):
        worker.run({"do": "crash"}, timeout=10)
    assert worker.alive and worker.run({"do": "answer"}, timeout=10)["state"] == "ready state"


def test_closing_ends_the_jobs_in_flight_and_waiting(worker):
    failures = run_then_close(worker)
    assert len(failures) == 3 and all(isinstance(f, WorkerClosed) for f in failures), failures
    assert not worker.alive


@pytest.mark.filterwarnings("ignore:.*fork:DeprecationWarning")
def test_closing_ends_the_jobs_even_while_a_stray_fork_holds_the_pipes(monkeypatch):
    """A process forked from the server while a worker starts (multiprocessing forks keep every
    descriptor) holds the worker's ends of the pipes open, so the worker's death brings no
    end-of-file: the jobs end all the same."""
    from trillm import fork_jobs

    holders = []

    def spawn_beside_a_fork(*args, **kwargs):
        process = spawn(*args, **kwargs)
        holder = os.fork()  # the worker's descriptors are still open here
        if holder == 0:
            time.sleep(60)
            os._exit(0)
        holders.append(holder)
        return process

    monkeypatch.setenv("PYTHONPATH", os.path.dirname(__file__))
    monkeypatch.setattr(fork_jobs, "spawn", spawn_beside_a_fork)
    try:
        with ForkWorker("fork_job_handler", b"ready state", 2, "test worker") as worker:
            failures = run_then_close(worker)
        assert len(failures) == 3 and all(isinstance(f, WorkerClosed) for f in failures), failures
    finally:
        for holder in holders:
            os.kill(holder, signal.SIGKILL)
            os.waitpid(holder, 0)


def run_then_close(worker: ForkWorker) -> list[BaseException]:
    """Three long jobs (two run, one waits for a slot), then the worker closed twice: what
    each job raised."""
    failures = []

    def job() -> None:
        try:
            worker.run({"do": "sleep", "seconds": 60}, timeout=120)
        except BaseException as exc:  # noqa: BLE001  (the callers' assertions name any other)
            failures.append(exc)

    threads = [threading.Thread(target=job) for _ in range(3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while len(children(worker._process.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.close()
    worker.close()  # idempotent
    for thread in threads:
        thread.join(timeout=30)
    return failures
