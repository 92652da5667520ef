# cython: language_level=3, wraparound=True
"""The model's per-token ops on CPU, compiled: the C kernels in ops_cpu.h behind the signatures of
their torch twins (norm.py, activation.py, rotary.py, cache.py), which are their references.
fp32 only; the GIL is released while each runs, and a prompt's rows are shared among the kernels'
pool (pool_cpu)."""
from libc.stdint cimport int64_t, uintptr_t

import torch

from trillm.kernels cimport pool_cpu
from trillm.kernels.attention_cpu import cache_kind
from trillm.kernels.cache import row_width
from trillm.kernels.ops_cpu_h cimport act_and_mul_pooled, rms_norm_pooled, rotary_embedding_pooled, write_kv_pooled


cdef inline float *address(t):
    return <float *><uintptr_t>t.data_ptr()


cdef check(t, dtype=torch.float32):
    assert t.dtype == dtype and t.device.type == "cpu", (t.dtype, t.device)


cdef int64_t rows_stride(t) except -1:
    """The distance between the rows of t ([T, size]), whose rows must each be contiguous."""
    assert t.dim() == 2 and t.stride(1) == 1, t.stride()
    return t.stride(0)


def rms_norm(x, weight, float eps):
    """As norm.rms_norm: x [T, hidden] -> [T, hidden]."""
    check(x), check(weight)
    assert weight.is_contiguous() and x.shape[-1] == weight.shape[0], (x.shape, weight.shape)
    out = torch.empty(x.shape, dtype=torch.float32)
    cdef int64_t T = x.shape[0], size = x.shape[1], stride = rows_stride(x)
    cdef float *out_ptr = address(out)
    cdef const float *x_ptr = address(x)
    cdef const float *w_ptr = address(weight)
    with nogil:
        rms_norm_pooled(pool_cpu.run, pool_cpu.chunks(), out_ptr, NULL, x_ptr, NULL, w_ptr, T, size, stride, eps)
    return out


def fused_add_rms_norm(x, residual, weight, float eps):
    """As norm.fused_add_rms_norm: returns (rms_norm(x + residual), x + residual)."""
    check(x), check(residual), check(weight)
    assert residual.is_contiguous() and weight.is_contiguous() and x.shape == residual.shape, (x.shape, residual.shape)
    assert x.shape[-1] == weight.shape[0], (x.shape, weight.shape)
    out = torch.empty(x.shape, dtype=torch.float32)
    summed = torch.empty(x.shape, dtype=torch.float32)
    cdef int64_t T = x.shape[0], size = x.shape[1], stride = rows_stride(x)
    cdef float *out_ptr = address(out)
    cdef float *sum_ptr = address(summed)
    cdef const float *x_ptr = address(x)
    cdef const float *r_ptr = address(residual)
    cdef const float *w_ptr = address(weight)
    with nogil:
        rms_norm_pooled(pool_cpu.run, pool_cpu.chunks(), out_ptr, sum_ptr, x_ptr, r_ptr, w_ptr, T, size, stride, eps)
    return out, summed


def silu_and_mul(x):
    """As activation.silu_and_mul: x [T, 2 * I] (gate | up) -> [T, I]."""
    return _act_and_mul(x, False)


def gelu_tanh_and_mul(x):
    """As activation.gelu_tanh_and_mul: x [T, 2 * I] (gate | up) -> [T, I]."""
    return _act_and_mul(x, True)


def _act_and_mul(x, bint gelu):
    check(x)
    assert x.is_contiguous() and x.shape[-1] % 2 == 0, (x.shape, x.stride())
    x2 = x.view(-1, x.shape[-1])
    cdef int64_t T = x2.shape[0], inter = x2.shape[1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=torch.float32)
    cdef float *out_ptr = address(out)
    cdef const float *x_ptr = address(x2)
    with nogil:
        act_and_mul_pooled(pool_cpu.run, pool_cpu.chunks(), out_ptr, x_ptr, T, inter, gelu)
    return out


cdef rotate(x, positions, cos_sin, bint is_neox):
    assert x.stride(2) == 1 and x.stride(1) == x.shape[2], x.stride()
    cdef int64_t T = x.shape[0], heads = x.shape[1], head_dim = x.shape[2], stride = x.stride(0)
    cdef float *x_ptr = address(x)
    cdef const int64_t *pos_ptr = <const int64_t *><uintptr_t>positions.data_ptr()
    cdef const float *cs_ptr = address(cos_sin)
    cdef int64_t max_positions = cos_sin.shape[0]
    cdef int rc
    with nogil:
        rc = rotary_embedding_pooled(pool_cpu.run, pool_cpu.chunks(), x_ptr, pos_ptr, cs_ptr, max_positions, T, heads,
                                     head_dim, stride, is_neox)
    if rc != 0:
        raise IndexError("rotary_embedding: a position is past the end of the cos/sin table")


def rotary_embedding(positions, q, k, cos_sin_cache, is_neox=True):
    """As rotary.rotary_embedding: rotates q [T, Hq, D] and k [T, Hk, D] in place (each token's
    heads contiguous, tokens strided, as views into the fused q|k|v output are)."""
    check(q), check(k), check(cos_sin_cache), check(positions, torch.int64)
    assert positions.is_contiguous() and cos_sin_cache.is_contiguous() and cos_sin_cache.shape[1] == q.shape[2]
    assert positions.shape == q.shape[:1] == k.shape[:1], (q.shape, k.shape, positions.shape)
    rotate(q, positions, cos_sin_cache, is_neox)
    rotate(k, positions, cos_sin_cache, is_neox)


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """As cache.write_kv: k, v [T, Hk, D] fp32 into their slots of the caches (fp32, fp16 or int8
    as cache.py lays them out; negative slots: skipped)."""
    check(k), check(v), check(k_cache, k_cache.dtype), check(v_cache, k_cache.dtype), check(slot_mapping, torch.int64)
    cdef int kind = cache_kind(k_cache, v_cache)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.is_contiguous() and slot_mapping.shape == k.shape[:1], (slot_mapping.shape, k.shape)
    assert k.shape == v.shape and k_cache.shape[2:] == (k.shape[1], row_width(k.shape[2], k_cache.dtype)), (
        k.shape, v.shape, k_cache.shape)
    assert k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == k.shape[2], (k.stride(), v.stride())
    cdef int64_t T = k.shape[0], num_kv_heads = k.shape[1], head_dim = k.shape[2]
    cdef int64_t num_slots = k_cache.shape[0] * k_cache.shape[1], k_stride = k.stride(0), v_stride = v.stride(0)
    cdef void *kc_ptr = <void *><uintptr_t>k_cache.data_ptr()
    cdef void *vc_ptr = <void *><uintptr_t>v_cache.data_ptr()
    cdef const float *k_ptr = address(k)
    cdef const float *v_ptr = address(v)
    cdef const int64_t *slots_ptr = <const int64_t *><uintptr_t>slot_mapping.data_ptr()
    cdef int rc
    with nogil:
        rc = write_kv_pooled(pool_cpu.run, pool_cpu.chunks(), kc_ptr, vc_ptr, kind, k_ptr, v_ptr, slots_ptr, T,
                             num_slots, num_kv_heads, head_dim, k_stride, v_stride)
    if rc != 0:
        raise IndexError("write_kv: a slot is past the end of the cache")
