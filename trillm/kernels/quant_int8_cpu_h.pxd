# The integer kernel of quant_int8_cpu.h, declared once for every module that calls it.
from libc.stdint cimport int8_t, int64_t, uint8_t, uintptr_t

from trillm.kernels.pool_cpu cimport pool_runner


cdef extern from "quant_int8_cpu.h" nogil:
    int INT8_GENERIC, INT8_AVX2, INT8_AVXVNNI, INT8_AVX512VNNI
    int int8_isa_supported(int isa)
    int int8_best_isa()
    cdef struct int8_weight:
        int bits
        int64_t tiles, blocks
        const uint8_t *u
        const uint8_t *h
        const float *d
        const float *m
        const uint8_t *sc
        const uint8_t *mn
        const float *dk
        const float *mk
    int int8_linear(float *out, const float *x, int64_t M, int64_t K, int64_t N, const int8_weight *weight,
                    int isa, pool_runner *run, int64_t chunks)
    void int8_quantize_rows(int isa, const float *x, int64_t M, int64_t K, int8_t *v, float *e, float *s)


cdef inline uintptr_t _address(t):
    return 0 if t is None else t.data_ptr()


cdef inline int8_weight int8_weight_of(linear):
    """The kernel's view of a quant_cpu.Int8QuantizedLinear's weight, pointing into the tensors
    that object keeps alive (int8_linear sets tiles and blocks)."""
    cdef int8_weight w
    w.bits = linear.bits
    w.tiles = w.blocks = 0
    w.u = <const uint8_t *>_address(linear.u)
    w.h = <const uint8_t *>_address(linear.h)
    w.d = <const float *>_address(linear.d)
    w.m = <const float *>_address(linear.m)
    w.sc = <const uint8_t *>_address(linear.sc)
    w.mn = <const uint8_t *>_address(linear.mn)
    w.dk = <const float *>_address(linear.dk)
    w.mk = <const float *>_address(linear.mk)
    return w
