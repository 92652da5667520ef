"""The scheduler and the KV block allocator, compiled with Cython.

Nothing here imports torch. The .pyx sources are written in Cython's pure-Python
mode, so they also run uncompiled: `load_uncompiled()` loads them as plain Python
under other module names, which the benchmark and the tests use to measure and to
check what compiling changes.
"""
import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType

try:
    from trillm.sched_ext.allocator import BlockAllocator, vllm_extra_keys
    from trillm.sched_ext.scheduler import Request, ScheduledRequest, Scheduler, SchedulerOutput
except ImportError as e:
    raise ImportError(
        "trillm.sched_ext is not built: run `python setup.py build_ext --inplace` "
        "(or `pip install -e .`) in the repository root") from e

from trillm.sched_ext.status import FinishReason, RequestStatus, SchedulingPolicy

WAITING, RUNNING, FINISHED = RequestStatus

__all__ = ["BlockAllocator", "FINISHED", "FinishReason", "RUNNING", "Request", "RequestStatus", "Scheduler",
           "ScheduledRequest", "SchedulerOutput", "SchedulingPolicy", "WAITING", "load_uncompiled", "vllm_extra_keys"]


def _load_source(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(module)
    return module


def load_uncompiled() -> tuple[ModuleType, ModuleType]:
    """The allocator and scheduler modules run from their .pyx sources as plain
    Python, the scheduler wired to the plain allocator (its own import of the
    allocator finds the compiled one)."""
    here = Path(__file__).parent
    allocator = _load_source("trillm.sched_ext.uncompiled_allocator", here / "allocator.pyx")
    scheduler = _load_source("trillm.sched_ext.uncompiled_scheduler", here / "scheduler.pyx")
    scheduler.BlockAllocator = allocator.BlockAllocator
    assert not allocator.COMPILED and not scheduler.COMPILED
    return allocator, scheduler
