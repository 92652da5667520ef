"""Jobs in forks of a worker process: answered, stopped at their deadline, held to their memory,
their crashes reported, and none of it taking the worker down."""
import os
import threading
import time

import pytest
from process_support import children

from trillm.fork_jobs import ForkWorker, JobOutOfMemory, JobTimeout, WorkerClosed


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
    failures = []

    def job() -> None:
        try:
            worker.run({"do": "sleep", "seconds": 60}, timeout=120)
        except WorkerClosed as exc:
            failures.append(exc)

    threads = [threading.Thread(target=job) for _ in range(3)]  # two run, one waits for a slot
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while len(children(worker._process.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.close()
    worker.close()  # idempotent
    for thread in threads:
        thread.join(timeout=30)
    assert len(failures) == 3 and not worker.alive
