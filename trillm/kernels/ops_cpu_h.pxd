# The C kernels of ops_cpu.h, declared once for every module that calls them.
from libc.stdint cimport int64_t

from trillm.kernels.pool_cpu cimport pool_runner


cdef extern from "ops_cpu.h" nogil:
    void rms_norm_f32(float *out, float *sum_out, const float *x, const float *residual, const float *weight,
                      int64_t T, int64_t size, int64_t x_stride, float eps)
    void rms_norm_pooled(pool_runner *run, int64_t chunks, float *out, float *sum_out, const float *x,
                         const float *residual, const float *weight, int64_t T, int64_t size, int64_t x_stride,
                         float eps)
    void act_and_mul_pooled(pool_runner *run, int64_t chunks, float *out, const float *x, int64_t T, int64_t inter,
                            int gelu)
    int rotary_embedding_pooled(pool_runner *run, int64_t chunks, float *x, const int64_t *positions,
                                const float *cos_sin, int64_t max_positions, int64_t T, int64_t heads,
                                int64_t head_dim, int64_t row_stride, int neox)
    int write_kv_pooled(pool_runner *run, int64_t chunks, void *k_cache, void *v_cache, int kind, const float *k,
                        const float *v, const int64_t *slots, int64_t T, int64_t num_slots, int64_t num_kv_heads,
                        int64_t head_dim, int64_t k_stride, int64_t v_stride)
