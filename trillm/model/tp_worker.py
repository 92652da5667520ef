"""Tensor-parallel ranks 1..N-1: how they are started and what they run.

On one machine, rank 0's EngineCore starts the others itself (`Workers.start`): each is forked
from a fork server that imported the model side once (trillm.subprocesses.start_preloaded), is
handed the engine's settings, and dies with that server, which ends with rank 0's process, so no
rank outlives the server, however it ends.
Across machines a launcher (torchrun) starts every rank with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set; `trillm serve` then serves HTTP on rank 0 and runs `run_worker` on the others.

A worker builds its shard (ModelRunner) and runs the steps rank 0 broadcasts until rank 0
sends its close, or dies: then the worker's next collective raises and it exits.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os

from trillm.config import EngineArgs
from trillm.heap import freeze_heap
from trillm.model import parallel
from trillm.subprocesses import free_port, start_preloaded

log = logging.getLogger(__name__)
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

    def __init__(self, processes: list[multiprocessing.Process]):
        self.processes = processes

    @classmethod
    def start(cls, args: EngineArgs) -> tuple[Workers, EngineArgs]:
        """Ranks 1..N-1 of `args`, and the args with the meeting point filled in (a free loopback
        port when none was given)."""
        if args.tp_init_method is None:
            args = dataclasses.replace(args, tp_init_method=f"tcp://127.0.0.1:{free_port()}")
        workers, started = cls([]), []
        try:
            for rank in range(1, args.tensor_parallel_size):
                reader, writer = multiprocessing.Pipe(duplex=False)
                started.append(reader)
                try:
                    workers.processes.append(start_preloaded(_rank_main, args, rank, writer))
                finally:
                    writer.close()
            _await_started(started)
        except BaseException:  # no rank outlives a start that failed, however far it got
            workers.stop(wait=False)
            raise
        finally:
            for reader in started:
                reader.close()
        return workers, args

    def all_alive(self) -> bool:
        return all(process.exitcode is None for process in self.processes)

    def stop(self, wait: bool = True) -> None:
        """Reap the workers: after up to STOP_TIMEOUT each when `wait` (they were told to stop),
        at once otherwise; a worker still there then is killed."""
        for process in self.processes:
            process.join(STOP_TIMEOUT if wait else 0)
            if process.exitcode is None:
                process.kill()
                process.join()
            process.close()
        self.processes = []


def _await_started(started: list[multiprocessing.connection.Connection]) -> None:
    """Until each rank (1, 2, ...) says on its pipe that its own code runs. A rank that dies
    before (a script re-imported as the main module without its `if __name__ == "__main__":`
    guard) closes its pipe unsaid: RuntimeError, rather than rank 0 waiting for it to meet."""
    for rank, reader in enumerate(started, 1):
        try:
            reader.recv_bytes()
        except EOFError:
            raise RuntimeError(
                f"Tensor-parallel rank {rank} exited before it started. A script that builds a tensor-parallel "
                'engine must do so under `if __name__ == "__main__":`: its ranks import the script again.'
            ) from None


def _rank_main(args: EngineArgs, rank: int, started: multiprocessing.connection.Connection) -> None:
    try:
        started.send_bytes(b"started")
    except BrokenPipeError:  # rank 0 gave up on this start (another rank failed first): nobody to meet
        return
    finally:
        started.close()
    logging.basicConfig(level=logging.INFO, format=f"[tp rank {rank}] %(levelname)s %(message)s")
    run_worker(args, rank)
