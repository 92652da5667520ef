from libc.stdint cimport int64_t


cdef extern from "shared_cpu.h" nogil:
    ctypedef void pool_chunk_fn(void *ctx, int64_t chunk) noexcept nogil
    ctypedef void pool_runner(pool_chunk_fn *fn, void *ctx, int64_t chunks) noexcept nogil


cdef void run(pool_chunk_fn *fn, void *ctx, int64_t chunks) noexcept nogil
cdef int64_t chunks() noexcept nogil
