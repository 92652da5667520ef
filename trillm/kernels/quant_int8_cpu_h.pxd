# The integer kernel of quant_int8_cpu.h, declared once for every module that calls it.
from libc.stdint cimport int64_t, uint8_t

from trillm.kernels.pool_cpu cimport pool_runner


cdef extern from "quant_int8_cpu.h" nogil:
    int INT8_GENERIC, INT8_AVX2, INT8_AVXVNNI, INT8_AVX512VNNI
    int int8_isa_supported(int isa)
    int int8_best_isa()
    int int8_linear(float *out, const float *x, int64_t M, int64_t K, int64_t N, int bits, const uint8_t *u,
                    const uint8_t *h, const float *d, const float *m, int isa, pool_runner *run, int64_t chunks)
