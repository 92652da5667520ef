# cython: language_level=3, wraparound=True
"""Linear layers on GGUF-quantized weights on CPU, compiled: the C kernel in quant_cpu.h behind a
torch-tensor API. Its reference is trillm/kernels/quant.py's `linear` (dequantize, then F.linear).
fp32 activations; the GIL is released while the kernel runs."""
from libc.stdint cimport int64_t, uintptr_t

import torch

from trillm.kernels.quant import BLOCK, QuantizedWeight

cdef extern from "quant_cpu.h" nogil:
    int QUANT_Q4_1
    int QUANT_Q8_0
    int TILE_N
    int quantized_linear_f32(float *out, const float *x, int64_t M, int64_t K, int64_t N, int format,
                              const void *quants, const float *scales, const float *mins)

FORMATS = {"q4_1": QUANT_Q4_1, "q8_0": QUANT_Q8_0}


class QuantizedLinear:
    """x -> x W^T (+ bias) for one QuantizedWeight, regrouped once into the kernel's tiles."""

    @staticmethod
    def runs(weight: QuantizedWeight) -> bool:
        """Whether the kernel takes this weight: its rows must fill tiles of 16."""
        return weight.format in FORMATS and weight.out_features % TILE_N == 0

    def __init__(self, weight: QuantizedWeight):
        assert self.runs(weight), (weight.format, weight.out_features)
        self.format = FORMATS[weight.format]
        self.out_features, self.in_features = weight.out_features, weight.in_features
        tiles, blocks = weight.out_features // TILE_N, weight.in_features // BLOCK

        def tiled(per_row):  # [N, blocks * c] -> [N / 16, blocks, c, 16]
            return per_row.reshape(tiles, TILE_N, blocks, -1).permute(0, 2, 3, 1).contiguous()

        self.quants, self.scales = tiled(weight.quants), tiled(weight.scales)
        self.mins = tiled(weight.mins) if weight.mins is not None else None

    def __call__(self, x, bias=None):
        """x [..., K] fp32 on the CPU -> [..., N] fp32."""
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] == self.in_features, (x.dtype, x.shape)
        x2 = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        cdef int64_t M = x2.shape[0], K = self.in_features, N = self.out_features
        cdef int fmt = self.format, rc
        cdef float *out_ptr = <float *><uintptr_t>out.data_ptr()
        cdef const float *x_ptr = <const float *><uintptr_t>x2.data_ptr()
        cdef const void *quants_ptr = <const void *><uintptr_t>self.quants.data_ptr()
        cdef const float *scales_ptr = <const float *><uintptr_t>self.scales.data_ptr()
        cdef const float *mins_ptr = <const float *><uintptr_t>(self.mins.data_ptr() if self.mins is not None else 0)
        with nogil:
            rc = quantized_linear_f32(out_ptr, x_ptr, M, K, N, fmt, quants_ptr, scales_ptr, mins_ptr)
        if rc != 0:
            raise MemoryError("quantized linear: no memory for the transposed rows")
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], N)
