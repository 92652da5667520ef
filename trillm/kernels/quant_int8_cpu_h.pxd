# The integer kernel of quant_int8_cpu.h, declared once for every module that calls it.
from libc.stdint cimport int8_t, int16_t, int64_t, uint8_t, uint16_t, uintptr_t

from trillm.kernels.pool_cpu cimport pool_runner


cdef extern from "quant_int8_cpu.h" nogil:
    int INT8_GENERIC, INT8_AVX2, INT8_AVXVNNI, INT8_AVX512VNNI, INT8_AMX
    int int8_isa_supported(int isa)
    int int8_best_isa()
    int int8_amx_refused()
    cdef struct int8_weight:
        int bits
        int64_t tiles, blocks
        const uint8_t *u
        const uint8_t *h
        const float *d
        const float *m
        const uint16_t *dh
        const uint16_t *mh
        float m_of_d
        const uint8_t *sc
        const uint8_t *mn
        const float *dk
        const float *mk
    int INT8_MAX_PARTS
    int int8_linear(float *out, const float *x, int64_t M, int64_t K, int64_t N, const int8_weight *weights,
                    int parts, int isa, pool_runner *run, int64_t chunks)
    void int8_quantize_rows(int isa, const float *x, int64_t M, int64_t K, int shift, int8_t *v, float *e, float *s,
                            int16_t *sums, int16_t *halves)


cdef inline uintptr_t _address(t):
    return 0 if t is None else t.data_ptr()


cdef inline uintptr_t _address_sized(t, int size):
    """t's address where its elements take `size` bytes (scales: fp32 4, fp16 2), else 0."""
    return 0 if t is None or t.element_size() != size else t.data_ptr()


cdef inline int int8_weights_of(linear, int8_weight *weights) except -1:
    """The kernel's view of a quant_cpu.Int8QuantizedLinear's weight, part by part, into weights
    [INT8_MAX_PARTS], pointing into the tensors that object keeps alive (int8_linear sets their
    blocks). Returns how many parts."""
    cdef int p
    assert len(linear.parts) <= INT8_MAX_PARTS
    for p, part in enumerate(linear.parts):
        weights[p].bits = part.bits
        weights[p].tiles = part.out_features // 16
        weights[p].blocks = 0
        weights[p].u = <const uint8_t *>_address(part.u)
        weights[p].h = <const uint8_t *>_address(part.h)
        weights[p].d = <const float *>_address_sized(part.d, 4)
        weights[p].m = <const float *>_address_sized(part.m, 4)
        weights[p].dh = <const uint16_t *>_address_sized(part.d, 2)
        weights[p].mh = <const uint16_t *>_address_sized(part.m, 2)
        weights[p].m_of_d = part.m_of_d
        weights[p].sc = <const uint8_t *>_address(part.sc)
        weights[p].mn = <const uint8_t *>_address(part.mn)
        weights[p].dk = <const float *>_address(part.dk)
        weights[p].mk = <const float *>_address(part.mk)
    return len(linear.parts)
