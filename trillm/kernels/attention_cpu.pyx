# cython: language_level=3
"""Paged attention on CPU, compiled: the C kernel in attention_cpu.h behind a torch-tensor API.

Same contract as the torch twin's `paged_attention` (trillm/kernels/attention.py), which is its
reference: a step of prompt chunks and decode rows, each query attending causally (and within
the sliding window) to its request's context in the paged cache. fp32 queries, an fp32, fp16 or
int8 cache (trillm/kernels/cache.py); a request's rows go in tiles shared among the threads of
pool_cpu, and the GIL is released while the kernel runs, so the server's event loop keeps going.
"""
from libc.stdint cimport int32_t, int64_t, uintptr_t

import torch

from trillm.kernels cimport pool_cpu
from trillm.kernels.cache import row_width
from trillm.kernels.attention_cpu_h cimport attention_lanes_supported, paged_attention_c

# enum kv_cache_kind (shared_cpu.h) of each cache dtype the compiled kernels read and write
CACHE_KINDS = {torch.float32: 0, torch.float16: 1, torch.int8: 2}
CACHE_DTYPES = tuple(CACHE_KINDS)


def cache_kind(k_cache, v_cache) -> int:
    """The enum kv_cache_kind of a pair of caches, which must share dtype and shape."""
    assert k_cache.dtype in CACHE_KINDS and v_cache.dtype == k_cache.dtype, (k_cache.dtype, v_cache.dtype)
    assert k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    return CACHE_KINDS[k_cache.dtype]


def lane_widths() -> list[int]:
    """The vector widths (fp32 lanes) this CPU runs the kernel in, the widest first: a width sums
    in its own order, so each gives its own bits."""
    return [lanes for lanes in (16, 8) if attention_lanes_supported(lanes)]


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, float scale, sliding_window=None,
                    int lanes=0):
    """q: [T, H, D] fp32; caches: [num_blocks, block_size, Hk, row_width] fp32, fp16 or int8
    (cache.py's layouts); block_tables:
    [B, max_blocks] int32; seq_lens: [B] int32; query_start_loc: [B + 1] int32 from 0 to T, or
    None when each request has one row (T == B). All contiguous, on the CPU. Returns [T, H, D]
    fp32. A request with no rows, or with more rows than its context, is a ValueError. `lanes`:
    one of lane_widths() (0: the widest, which the engine runs)."""
    assert lanes == 0 or lanes in lane_widths(), (lanes, lane_widths())
    cdef int kind = cache_kind(k_cache, v_cache)
    checked = [(q, torch.float32), (k_cache, k_cache.dtype), (v_cache, k_cache.dtype), (block_tables, torch.int32),
               (seq_lens, torch.int32)]
    if query_start_loc is not None:
        checked.append((query_start_loc, torch.int32))
    for t, dtype in checked:
        assert t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous(), (t.dtype, t.device, t.shape)
    assert k_cache.shape[3] == row_width(q.shape[2], k_cache.dtype) and q.shape[1] % k_cache.shape[2] == 0
    assert block_tables.shape[0] == seq_lens.shape[0]
    if query_start_loc is None:
        assert q.shape[0] == seq_lens.shape[0], (q.shape, seq_lens.shape)
    else:
        assert query_start_loc.shape[0] == seq_lens.shape[0] + 1, (query_start_loc.shape, seq_lens.shape)
        assert query_start_loc[0] == 0 and query_start_loc[-1] == q.shape[0], (query_start_loc, q.shape)
    out = torch.empty_like(q)
    cdef int64_t num_seqs = seq_lens.shape[0], num_heads = q.shape[1], head_dim = q.shape[2]
    cdef int64_t block_size = k_cache.shape[1], num_kv_heads = k_cache.shape[2]
    cdef int64_t max_blocks = block_tables.shape[1], window = sliding_window or 0
    cdef float *out_ptr = <float *><uintptr_t>out.data_ptr()
    cdef const float *q_ptr = <const float *><uintptr_t>q.data_ptr()
    cdef const void *k_ptr = <const void *><uintptr_t>k_cache.data_ptr()
    cdef const void *v_ptr = <const void *><uintptr_t>v_cache.data_ptr()
    cdef const int32_t *tables_ptr = <const int32_t *><uintptr_t>block_tables.data_ptr()
    cdef const int32_t *lens_ptr = <const int32_t *><uintptr_t>seq_lens.data_ptr()
    cdef const int32_t *starts_ptr = NULL
    if query_start_loc is not None:
        starts_ptr = <const int32_t *><uintptr_t>query_start_loc.data_ptr()
    cdef int rc
    with nogil:
        rc = paged_attention_c(out_ptr, q_ptr, k_ptr, v_ptr, kind, tables_ptr, lens_ptr, starts_ptr, num_seqs,
                               num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale, window, lanes,
                               pool_cpu.run, pool_cpu.chunks())
    if rc == -2:
        raise ValueError("paged_attention: a request has no query rows, or more rows than its context")
    if rc != 0:
        raise MemoryError("paged_attention: no memory for the scores")
    return out
