# The C kernel of attention_cpu.h, declared once for every module that calls it.
from libc.stdint cimport int32_t, int64_t

from trillm.kernels.pool_cpu cimport pool_runner


cdef extern from "attention_cpu.h" nogil:
    int paged_attention_c "paged_attention"(
        float *out, const float *q, const void *k_cache, const void *v_cache, int kind,
        const int32_t *block_tables, const int32_t *seq_lens, const int32_t *query_start_loc,
        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
        int64_t block_size, int64_t max_blocks, float scale, int64_t window, int lanes, pool_runner *run,
        int64_t chunks)
    int attention_lanes_supported(int lanes)
