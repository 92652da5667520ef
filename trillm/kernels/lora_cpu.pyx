# cython: language_level=3
"""The grouped LoRA multiply on CPU, compiled: lora_cpu.h behind the signature of its torch twin,
trillm/kernels/lora.py. fp32 only; its rows are shared among the threads of pool_cpu; the GIL is
released while it runs."""
from libc.stdint cimport int64_t, uintptr_t

import torch

from trillm.kernels cimport pool_cpu
from trillm.kernels.pool_cpu cimport pool_runner

cdef extern from "lora_cpu.h" nogil:
    int lora_add_f32(float *y, const float *x, const float *a, const float *b, const int64_t *slots, int64_t T,
                     int64_t S, int64_t n_in, int64_t n_out, int64_t K, int64_t x_stride, int64_t y_stride,
                     const int64_t *out_offsets, int64_t parts, pool_runner *run, int64_t chunks)


def lora_add(y, x, a, b, slots, out_offsets=None):
    """As lora.lora_add: y [T, out] += (a[slots[t]] @ x[t]) @ b[slots[t]] where slots[t] >= 0, in
    place; with `out_offsets` (a list, or an int64 tensor: made once by the caller, it saves the
    conversion on every call), b's zero blocks are skipped. Checks are few: this runs for every
    adapted projection of every step."""
    cdef int64_t T = x.shape[0], n_in = x.shape[1], n_out = y.shape[1], S = a.shape[0], K = a.shape[1]
    if not isinstance(out_offsets, torch.Tensor):
        out_offsets = torch.tensor(out_offsets if out_offsets is not None else [0, n_out], dtype=torch.int64)
    cdef int64_t parts = out_offsets.shape[0] - 1
    assert (x.dtype == y.dtype == a.dtype == b.dtype == torch.float32 and slots.dtype == out_offsets.dtype == torch.int64
            and x.device.type == "cpu" and y.device.type == "cpu")
    assert a.is_contiguous() and b.is_contiguous() and slots.is_contiguous() and out_offsets.is_contiguous()
    assert x.stride(1) == 1 and y.stride(1) == 1 and y.shape[0] == T and slots.shape[0] == T
    assert a.shape[2] == n_in and b.shape[0] == S and b.shape[1] == K and b.shape[2] == n_out and K % parts == 0
    cdef int64_t x_stride = x.stride(0), y_stride = y.stride(0)
    cdef float *y_ptr = <float *><uintptr_t>y.data_ptr()
    cdef const float *x_ptr = <const float *><uintptr_t>x.data_ptr()
    cdef const float *a_ptr = <const float *><uintptr_t>a.data_ptr()
    cdef const float *b_ptr = <const float *><uintptr_t>b.data_ptr()
    cdef const int64_t *s_ptr = <const int64_t *><uintptr_t>slots.data_ptr()
    cdef const int64_t *o_ptr = <const int64_t *><uintptr_t>out_offsets.data_ptr()
    cdef int64_t chunks = pool_cpu.chunks()
    cdef int rc
    with nogil:
        rc = lora_add_f32(y_ptr, x_ptr, a_ptr, b_ptr, s_ptr, T, S, n_in, n_out, K, x_stride, y_stride, o_ptr, parts,
                          pool_cpu.run, chunks)
    if rc == -1:
        raise MemoryError("lora_add: no memory to group the rows by slot")
    if rc == -2:
        raise ValueError(f"lora_add: a slot outside [-1, {S}) or parts' offsets outside [0, {n_out}]")
