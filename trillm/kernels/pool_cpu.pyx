# cython: language_level=3
"""The process's one pool of helper threads for the compiled CPU kernels (pool_cpu.h says how it
works). Kernels' modules cimport `run` and hand it to their C code as its pool_runner."""
from libc.stdint cimport int64_t

cdef extern from "pool_cpu.h" nogil:
    void pool_run(pool_chunk_fn *fn, void *ctx, int64_t chunks)
    int pool_set_helpers(int helpers)

# pieces a job is cut into per thread: a helper that starts late still finds some, and no thread
# is left with one large remainder
cdef int CHUNKS_PER_THREAD = 4

cdef int _threads = 1


cdef void run(pool_chunk_fn *fn, void *ctx, int64_t chunks) noexcept nogil:
    pool_run(fn, ctx, chunks)


def set_threads(int threads) -> int:
    """Threads the kernels use, the caller's included (at least 1): helpers are started once, and
    spin briefly, then sleep, between jobs. Returns the number in effect."""
    global _threads
    with nogil:
        _threads = 1 + pool_set_helpers(max(threads, 1) - 1)
    return _threads


cdef int64_t chunks() noexcept nogil:
    """How many pieces a job should be cut into."""
    return _threads * CHUNKS_PER_THREAD
