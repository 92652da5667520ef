"""Tensor parallelism: this process's place in the group of ranks that shard one model, and the
collectives the sharded model and the step loop run, all over torch.distributed (gloo on CPU,
NCCL on CUDA).

Rank 0 owns the scheduler, the sampler and the HTTP side; every rank holds a shard of every
projection (trillm/model/llama.py says which) and its heads' share of the KV cache, so every
rank allocates the same blocks and the scheduler does not know the model is sharded.

Two process groups, for two kinds of waiting (a gloo timeout is each process's own):
  control   rank 0 broadcasts each step's inputs; a worker waits here between steps, for as
            long as the server is idle, so its timeout is effectively unbounded, while rank
            0's send, which completes only when the worker takes it, is bounded by `timeout`.
  compute   the forward's all-reduces and the logits' gather. Every rank is inside the same
            step, so a rank that does not arrive within `timeout` is hung: the collective
            raises, the step fails, and the engine fails as on any failed step.
A rank that dies closes its connections, and the others' next collective raises at once.
"""
from __future__ import annotations

import datetime
import glob
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from trillm.subprocesses import cpu_share, even_span

CONTROL_TIMEOUT = datetime.timedelta(days=365)  # an idle server's workers wait this long for a step
STARTUP_TIMEOUT = datetime.timedelta(minutes=30)  # for every rank to start, meet and load its shard


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    control: object | None = None  # process groups; None for a single rank
    compute: object | None = None

    def split(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of n things split as evenly as can be (the first n % size
        ranks take one more)."""
        return even_span(n, self.rank, self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.compute)
        return x

    def gather_columns(self, x: torch.Tensor, full: int) -> torch.Tensor:
        """[rows, full]: every rank's columns [rows, its split of full], side by side, on every rank."""
        if self.size == 1:
            return x
        width = -(-full // self.size)
        padded = torch.nn.functional.pad(x, (0, width - x.shape[1]))
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded.contiguous(), group=self.compute)
        widths = [end - start for start, end in (TensorParallel(r, self.size).split(full) for r in range(self.size))]
        return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1)

    def minimum(self, n: int) -> int:
        """The smallest n of all ranks, on every rank; at start-up, so it waits as long as the
        slowest rank takes to load its shard (STARTUP_TIMEOUT)."""
        if self.size == 1:
            return n
        value = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return int(value.item())

    def broadcast(self, message=None):
        """Rank 0's `message` on every rank (the workers pass none). Workers wait here between steps."""
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


SINGLE = TensorParallel()


def rank_cpus(tp: TensorParallel) -> set[int]:
    """The cores this rank's threads run on: its NUMA node's, where the machine has a node per
    rank, else its even share of the cores this process may use (ranks sharing cores would
    fight over them at every collective)."""
    nodes = sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"))
    if len(nodes) >= tp.size:
        with open(nodes[tp.rank]) as f:
            mine = _cpu_list(f.read()) & os.sched_getaffinity(0)
        if mine:
            return mine
    return cpu_share(tp.rank, tp.size)


def _cpu_list(text: str) -> set[int]:
    """Linux's cpulist format: "0-3,8,10-11"."""
    cpus = set()
    for part in filter(None, text.strip().split(",")):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def join(rank: int, size: int, init_method: str, device: torch.device, timeout: float,
         others_alive: Callable[[], bool] | None = None) -> TensorParallel:
    """Joins the group of `size` ranks that meet at `init_method` (tcp://host:port, where rank 0
    runs the store; or env://, a launcher's). `timeout`: seconds a step's collectives wait for a
    late rank. `others_alive`, for rank 0 when it started the other ranks: whether they all still
    run. A rank that exits before the group has met fails the join at once (RuntimeError),
    where the meeting alone would wait for it for STARTUP_TIMEOUT."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    step_timeout = datetime.timedelta(seconds=timeout)
    if init_method.startswith("tcp://"):
        store = _meet(rank, size, init_method, others_alive)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=STARTUP_TIMEOUT)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=STARTUP_TIMEOUT)
    # A timeout is each process's own: the workers wait for steps unboundedly, while rank 0's
    # sends of a step (which gloo completes only when the worker receives) are bounded.
    control = dist.new_group(backend="gloo", timeout=step_timeout if rank == 0 else CONTROL_TIMEOUT)
    compute = dist.new_group(backend=backend, timeout=step_timeout)
    return TensorParallel(rank, size, control, compute)


def _meet(rank: int, size: int, init_method: str, others_alive: Callable[[], bool] | None) -> dist.Store:
    """The group's store at `init_method` (rank 0 serves it), with this rank's arrival marked in
    it; on rank 0, once every rank has arrived. Rank 0 waits here, watching `others_alive`, and
    not in the process group's own meeting, whose wait no check can cut short."""
    address = urlsplit(init_method)
    store = dist.TCPStore(address.hostname, address.port, size, is_master=rank == 0, timeout=STARTUP_TIMEOUT,
                          wait_for_workers=False)
    store.set(f"trillm/arrived/{rank}", "1")
    if rank == 0:
        others = [f"trillm/arrived/{other}" for other in range(1, size)]
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        while not store.check(others):
            if others_alive is not None and not others_alive():
                raise RuntimeError("A tensor-parallel rank exited before the ranks met: its log says why.")
            if time.monotonic() > deadline:
                raise RuntimeError(f"The tensor-parallel ranks did not all meet at {init_method} "
                                   f"within {STARTUP_TIMEOUT}.")
            time.sleep(0.05)
    return store


def leave() -> None:
    """Idempotent."""
    if dist.is_initialized():
        dist.destroy_process_group()
