"""A handler for trillm.fork_jobs' tests: its state is the setup payload; a job says what to do."""
import os
import time


def setup(payload: bytes) -> str:
    return payload.decode()


def run(state: str, job: dict) -> dict:
    if job["do"] == "sleep":
        time.sleep(job["seconds"])
    elif job["do"] == "allocate":
        b"x" * job["bytes"]
    elif job["do"] == "crash":
        os._exit(3)
    return {"state": state, "pid": os.getpid()}
