# cython: language_level=3
"""The grouped LoRA multiply on CPU, compiled: lora_cpu.h behind the signature of its torch twin,
trillm/kernels/lora.py. fp32 only; its rows are shared among the threads of pool_cpu; the GIL is
released while it runs."""
from libc.stdint cimport int64_t, uintptr_t

import torch

from trillm.kernels cimport pool_cpu
from trillm.kernels.pool_cpu cimport pool_runner

cdef extern from "lora_cpu.h" nogil:
    int LORA_MAX_K
    int lora_add_f32(float *y, const float *x, const float *a, const float *b, const int64_t *slots, int64_t T,
                     int64_t n_in, int64_t n_out, int64_t K, int64_t x_stride, int64_t y_stride, pool_runner *run,
                     int64_t chunks)

MAX_K = LORA_MAX_K


def lora_add(y, x, a, b, slots):
    """As lora.lora_add: y [T, out] += b[slots[t]] @ (a[slots[t]] @ x[t]) where slots[t] >= 0, in place."""
    for t in (y, x, a, b):
        assert t.dtype == torch.float32 and t.device.type == "cpu", (t.dtype, t.device)
    assert slots.dtype == torch.int64 and slots.is_contiguous()
    assert a.is_contiguous() and b.is_contiguous() and x.stride(1) == 1 and y.stride(1) == 1
    cdef int64_t T = x.shape[0], n_in = x.shape[1], n_out = y.shape[1], K = a.shape[1]
    assert a.shape[2] == n_in and tuple(b.shape[1:]) == (n_out, K) and slots.shape[0] == T and y.shape[0] == T
    cdef int64_t x_stride = x.stride(0), y_stride = y.stride(0)
    cdef float *y_ptr = <float *><uintptr_t>y.data_ptr()
    cdef const float *x_ptr = <const float *><uintptr_t>x.data_ptr()
    cdef const float *a_ptr = <const float *><uintptr_t>a.data_ptr()
    cdef const float *b_ptr = <const float *><uintptr_t>b.data_ptr()
    cdef const int64_t *s_ptr = <const int64_t *><uintptr_t>slots.data_ptr()
    cdef int64_t chunks = pool_cpu.chunks()
    cdef int rc
    with nogil:
        rc = lora_add_f32(y_ptr, x_ptr, a_ptr, b_ptr, s_ptr, T, n_in, n_out, K, x_stride, y_stride, pool_cpu.run, chunks)
    if rc != 0:
        raise ValueError(f"LoRA ranks summed over a projection's parts must be at most {MAX_K}, got {K}")
