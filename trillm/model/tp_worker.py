"""Tensor-parallel ranks 1..N-1: how they are started and what they run.

On one machine, rank 0's EngineCore starts the others itself (`Workers.start`): each is
`python -m trillm.model.tp_worker RANK`, given the engine's settings in its environment, and
dies with its parent (PR_SET_PDEATHSIG), so no rank outlives the server, however it ends.
Across machines a launcher (torchrun) starts every rank with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set; `trillm serve` then serves HTTP on rank 0 and runs `run_worker` on the others.

A worker builds its shard (ModelRunner) and runs the steps rank 0 broadcasts until rank 0
sends its close, or dies: then the worker's next collective raises and it exits.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

from trillm.config import EngineArgs
from trillm.heap import freeze_heap
from trillm.model import parallel
from trillm.subprocesses import free_port, spawn

log = logging.getLogger(__name__)
ARGS_VARIABLE = "TRILLM_TP_ENGINE_ARGS"
STOP_TIMEOUT = 10.0  # seconds a worker gets to exit after rank 0's close, before it is killed


def launcher_rank() -> int | None:
    """This process's rank when a launcher (torchrun) started it; None otherwise."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def launcher_init_method() -> str:
    """The launcher's meeting point, from its environment (torchrun's agent may host the store
    there itself, which "env://" knows to reuse)."""
    return "env://"


def run_worker(args: EngineArgs, rank: int) -> None:
    """Rank `rank`'s whole life (see the module docstring). Returns when rank 0 closes or dies."""
    from trillm.model.loader import resolve_device
    from trillm.model.runner import ModelRunner

    tp = parallel.join(rank, args.tensor_parallel_size, args.tp_init_method, resolve_device(args.device), args.tp_timeout)
    try:
        runner = ModelRunner(args, tp)
        freeze_heap()  # a collection's stall on one rank would stall every rank's step
        runner.serve_steps()
    except RuntimeError as exc:  # a collective failed: rank 0 is gone
        log.info("tensor-parallel rank %d stops: %s", rank, exc)
    finally:
        parallel.leave()


class Workers:
    """The worker processes rank 0 started; `stop()` is idempotent."""

    def __init__(self, processes: list[subprocess.Popen]):
        self.processes = processes

    @classmethod
    def start(cls, args: EngineArgs) -> tuple[Workers, EngineArgs]:
        """Ranks 1..N-1 of `args`, and the args with the meeting point filled in (a free loopback
        port when none was given)."""
        if args.tp_init_method is None:
            args = dataclasses.replace(args, tp_init_method=f"tcp://127.0.0.1:{free_port()}")
        env = {**os.environ, ARGS_VARIABLE: json.dumps(dataclasses.asdict(args))}
        processes = [
            spawn([sys.executable, "-m", "trillm.model.tp_worker", str(rank)], env=env)
            for rank in range(1, args.tensor_parallel_size)
        ]
        return cls(processes), args

    def stop(self, wait: bool = True) -> None:
        """Reap the workers: after up to STOP_TIMEOUT each when `wait` (they were told to stop),
        at once otherwise; a worker still there then is killed."""
        for process in self.processes:
            try:
                process.wait(STOP_TIMEOUT if wait else 0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def main(argv: list[str] | None = None) -> None:
    (rank,) = argv if argv is not None else sys.argv[1:]
    args = EngineArgs(**json.loads(os.environ[ARGS_VARIABLE]))
    logging.basicConfig(level=logging.INFO, format=f"[tp rank {rank}] %(levelname)s %(message)s")
    run_worker(args, int(rank))


if __name__ == "__main__":
    main()
