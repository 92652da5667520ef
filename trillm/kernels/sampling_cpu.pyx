# cython: language_level=3
"""Sampling on CPU, compiled: the C kernels in sampling_cpu.h behind the signatures of their torch
twins, sampler.inverse_cdf of a softmax and argmax, their references. The GIL is released while it runs."""
from libc.stdint cimport int64_t, uintptr_t

import torch


cdef extern from "sampling_cpu.h" nogil:
    int sample_rows_f32(int64_t *out, const float *logits, const double *uniform, int64_t R, int64_t V,
                        int64_t stride)
    void argmax_rows_f32(int64_t *out, const float *logits, int64_t R, int64_t V, int64_t stride)


cdef check_rows(logits):
    assert logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2
    assert logits.stride(1) == 1, logits.stride()


def sample(logits, uniform):
    """One token per row of `logits` [R, V] fp32 (each row contiguous), drawn from the row's
    softmax at `uniform` [R] float64 (each in [0, 1)) by inverse CDF -> [R] int64."""
    check_rows(logits)
    assert uniform.dtype == torch.float64 and uniform.device.type == "cpu" and uniform.shape == (logits.shape[0],)
    uniform = uniform.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    cdef int64_t *out_ptr = <int64_t *><uintptr_t>out.data_ptr()
    cdef const float *x_ptr = <const float *><uintptr_t>logits.data_ptr()
    cdef const double *u_ptr = <const double *><uintptr_t>uniform.data_ptr()
    cdef int64_t R = logits.shape[0], V = logits.shape[1], stride = logits.stride(0)
    cdef int rc
    with nogil:
        rc = sample_rows_f32(out_ptr, x_ptr, u_ptr, R, V, stride)
    if rc != 0:
        raise MemoryError("sampling: out of memory")
    return out


def argmax(logits):
    """As logits.argmax(dim=-1) for `logits` [R, V] fp32 (each row contiguous) -> [R] int64."""
    check_rows(logits)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    cdef int64_t *out_ptr = <int64_t *><uintptr_t>out.data_ptr()
    cdef const float *x_ptr = <const float *><uintptr_t>logits.data_ptr()
    cdef int64_t R = logits.shape[0], V = logits.shape[1], stride = logits.stride(0)
    with nogil:
        argmax_rows_f32(out_ptr, x_ptr, R, V, stride)
    return out
