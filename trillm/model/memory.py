"""What the process holds in memory, for sleep mode's report of what it freed."""
from __future__ import annotations

import ctypes
import gc
import os

import torch


def in_use(device: torch.device) -> int:
    """Bytes in use: the process's resident set on CPU, the device's used memory on CUDA
    (every process's, as nvidia-smi counts it)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def give_back(device: torch.device) -> None:
    """Return freed memory to the system: unreachable tensors collected, then CUDA's cached blocks
    released, or on CPU glibc's free lists trimmed (large tensors are their own mappings and go
    at once; smaller ones would otherwise stay in the heap)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: what was freed stays in the allocator's lists
        pass
