# cython: language_level=3, wraparound=True
"""Linear layers on GGUF-quantized weights on CPU, compiled, behind a torch-tensor API: the fp32
kernel in quant_cpu.h (QuantizedLinear, the exact path) and the integer one in quant_int8_cpu.h
(Int8QuantizedLinear, activations quantized to 8 bits). Their references are trillm/kernels/
quant.py's `linear` and `linear_int8`. Both share their output tiles among the threads of
pool_cpu; the GIL is released while a kernel runs."""
from libc.stdint cimport int8_t, int64_t, uint8_t, uint16_t, uint32_t, uintptr_t
from libc.string cimport memcpy

import itertools

import numpy as np
import torch

from trillm.kernels cimport pool_cpu
from trillm.kernels.pool_cpu cimport pool_runner
from trillm.kernels.quant_int8_cpu_h cimport (
    INT8_AMX, INT8_AVX2, INT8_AVX512VNNI, INT8_AVXVNNI, INT8_GENERIC, INT8_MAX_PARTS, int8_amx_refused, int8_best_isa,
    int8_isa_supported, int8_linear, int8_quantize_rows, int8_weight, int8_weights_of,
)

from trillm.kernels import quant
from trillm.kernels.quant import (
    BLOCK, LAYOUT_BYTES, SUPER_BLOCKS, FileBlocks, FileShards, QuantizedParts, QuantizedRows, QuantizedWeight,
    RowSlices, weight_of_rows,
)

cdef extern from "quant_cpu.h" nogil:
    int QUANT_Q4_1
    int QUANT_Q8_0
    int QUANT_Q5_1
    int TILE_N
    int quantized_linear_f32(float *out, const float *x, int64_t M, int64_t K, int64_t N, int format,
                              const void *quants, const float *scales, const float *mins, const uint32_t *highs,
                              pool_runner *run, int64_t chunks)


FORMATS = {"q4_1": QUANT_Q4_1, "q5_1": QUANT_Q5_1, "q8_0": QUANT_Q8_0}
# the integer kernel's paths, widest last
ISAS = {"generic": INT8_GENERIC, "avx2": INT8_AVX2, "avx_vnni": INT8_AVXVNNI, "avx512_vnni": INT8_AVX512VNNI,
        "amx": INT8_AMX}
def isas() -> list[str]:
    """The integer kernel's paths this CPU runs, widest last."""
    return [name for name, isa in ISAS.items() if int8_isa_supported(isa)]


def amx_refused() -> bool:
    """Whether the CPU has AMX's integer tiles and Linux refused this process their state."""
    return bool(int8_amx_refused())


def runs(weight: QuantizedWeight | RowSlices) -> bool:
    """Whether the fp32 kernel takes this weight: its rows must fill tiles of 16."""
    return (isinstance(weight, (QuantizedWeight, RowSlices)) and weight.format in FORMATS
            and weight.out_features % TILE_N == 0)


# the integer kernel's layouts and their bits (quant_int8_cpu.h)
INT8_BITS = {"q4_1": 4, "q5_1": 5, "q6_k": 6, "q8_0": 8}
# the file formats Int8Part regroups straight from a file's blocks (Int8Part.of_file), their bits
FILE_FORMATS = {"q4_0": 4, "q4_1": 4, "q5_0": 5, "q5_1": 5, "q8_0": 8, "q4_k": 4, "q5_k": 5, "q6_k": 6}
# the formats of blocks of 32 among them: where a block keeps its min and fifth bits (a byte
# offset, or -1: none), and its quants; the m each implies as a multiple of d (0: none)
BLOCKS_OF_32 = {"q4_0": (-1, -1, 2, -8.0), "q4_1": (2, -1, 4, 0.0), "q5_0": (-1, 2, 6, -16.0),
                "q5_1": (2, 4, 8, 0.0), "q8_0": (-1, -1, 2, 0.0)}


def int8_runs(weight: QuantizedWeight | QuantizedParts | RowSlices | FileShards) -> bool:
    """Whether the integer kernel takes this weight (each part's): its rows must fill tiles of 16;
    a file's shards, in the formats it regroups from the file (FILE_FORMATS), no two runs next to
    each other of one layout (quant.cat stacks such runs into one part, which the file's do not)."""
    if isinstance(weight, QuantizedParts):
        return len(weight.parts) <= INT8_MAX_PARTS and all(int8_runs(w) for w in weight.parts)
    if isinstance(weight, FileShards):
        runs = weight.runs()
        layouts = [quant.LAYOUT_OF[run[0].file_format] for run in runs]
        return len(runs) <= INT8_MAX_PARTS and all(a != b for a, b in zip(layouts, layouts[1:])) and all(
            run[0].file_format in FILE_FORMATS and sum(shard.out_features for shard in run) % TILE_N == 0
            for run in runs)
    return weight.format in INT8_BITS and weight.out_features % TILE_N == 0


TILES_AT_ONCE = 256  # a weight is regrouped this many tiles (4096 rows) at a time


def _tiled(per_row, tiles: int, blocks: int, lanes: int = 1, transform=None):
    """[N, blocks * c * lanes] -> [N / 16, blocks, c, 16] (lanes > 1: [N / 16, blocks, c, 16,
    lanes], `lanes` bytes of a row kept together, moved as one 32-bit word where there are 4):
    a tile's 16 rows side by side, block by block. Regrouped TILES_AT_ONCE tiles at a time into
    one tensor, `transform` applied to each slice first, so that the permuted temporaries are a
    slice's size, not the weight's. (The input itself stays whole until it is dropped: a
    vocabulary projection comes as RowSlices, _TiledLinear._regroup_by_rows.)"""
    words = lanes == 4
    out = None
    for start in range(0, tiles, TILES_AT_ONCE):
        part = per_row[start * TILE_N : (start + TILES_AT_ONCE) * TILE_N]
        if transform is not None:
            part = transform(part)
        if words:
            part = part.contiguous().view(torch.int32)
        grouped = 1 if words else lanes
        part = part.reshape(-1, TILE_N, blocks, part.shape[1] // blocks // grouped, grouped).permute(0, 2, 3, 1, 4)
        if out is None:
            out = part.new_empty((tiles, *part.shape[1:]))
        out[start : start + part.shape[0]] = part
    if words:
        return out.view(torch.uint8)
    return out if lanes > 1 else out.squeeze(-1)


def _split_nibbles(weight: QuantizedWeight):
    """A q5_1 or q6_k weight's quants as ([N, K / 2] nibbles laid out as q4_1's, [N, K / 32, c]
    bytes of the top bits: q5_1's 4, bit j of a block's little-endian word input j's; q6_k's 8,
    input j's bit pair at bits 2 (j / 8) of byte j % 8); for other formats (quants, None)."""
    if weight.format not in ("q5_1", "q6_k"):
        return weight.quants, None
    rows, blocks = weight.out_features, weight.in_features // BLOCK
    per_block = weight.quants.reshape(rows, blocks, LAYOUT_BYTES[weight.format])
    return per_block[..., : BLOCK // 2].reshape(rows, -1), per_block[..., BLOCK // 2 :]


def requantize(weight) -> QuantizedWeight:
    """quant.requantize, bit for bit, with the integer kernel's own quantizer of rows (the C twin
    of quant.quantize_rows, on its widest path): a file's Q6_K tensors become 8-bit blocks at
    load in a fraction of the torch twin's time."""
    weight = weight.float().contiguous()
    cdef int64_t M = weight.shape[0], K = weight.shape[1]
    assert K % BLOCK == 0, K
    v = torch.empty(M, K, dtype=torch.int8)
    e = torch.empty(M, K // BLOCK, dtype=torch.float32)
    s = torch.empty(M, K // BLOCK, dtype=torch.float32)
    cdef const float *x_ptr = <const float *><uintptr_t>weight.data_ptr()
    cdef int8_t *v_ptr = <int8_t *><uintptr_t>v.data_ptr()
    cdef float *e_ptr = <float *><uintptr_t>e.data_ptr()
    cdef float *s_ptr = <float *><uintptr_t>s.data_ptr()
    cdef int isa = int8_best_isa()
    with nogil:
        int8_quantize_rows(isa, x_ptr, M, K, 0, v_ptr, e_ptr, s_ptr, NULL, NULL)
    return weight_of_rows(QuantizedRows(v, e, s))


cdef void _q4_k_quants(const uint8_t *src, int64_t supers, int64_t stride, uint8_t *out) noexcept nogil:
    """Q4_K super-blocks (`stride` bytes apart, their 128 bytes of nibbles at 16) -> eight q4_1
    blocks of 16 bytes each: 32-byte chunk c holds sub-block 2c in its low nibbles and 2c + 1 in
    its high ones, value j of a chunk in byte j."""
    cdef int64_t n
    cdef int c, j
    cdef const uint8_t *qs
    for n in range(supers):
        qs = src + n * stride + 16
        for c in range(4):
            for j in range(16):
                out[(2 * c) * 16 + j] = (qs[32 * c + j] & 15) | ((qs[32 * c + j + 16] & 15) << 4)
                out[(2 * c + 1) * 16 + j] = (qs[32 * c + j] >> 4) | (qs[32 * c + j + 16] & 0xF0)
        out += 128


cdef void _q5_k_quants(const uint8_t *src, int64_t supers, uint8_t *out) noexcept nogil:
    """Q5_K super-blocks (176 bytes: 32 bytes of fifth bits at 16, bit s of byte l value l of
    sub-block s's; nibbles at 48 as Q4_K's) -> eight q5_1 blocks of 20 bytes: the nibbles, then
    a little-endian word whose bit j is input j's fifth bit."""
    cdef int64_t n
    cdef int c, j, s, a, b
    cdef const uint8_t *qs
    cdef const uint8_t *qh
    cdef uint8_t byte
    for n in range(supers):
        qh = src + n * 176 + 16
        qs = qh + 32
        for c in range(4):
            for j in range(16):
                out[(2 * c) * 20 + j] = (qs[32 * c + j] & 15) | ((qs[32 * c + j + 16] & 15) << 4)
                out[(2 * c + 1) * 20 + j] = (qs[32 * c + j] >> 4) | (qs[32 * c + j + 16] & 0xF0)
        for s in range(8):
            for a in range(4):
                byte = 0
                for b in range(8):
                    byte |= ((qh[8 * a + b] >> s) & 1) << b
                out[s * 20 + 16 + a] = byte
        out += 160


cdef void _q6_k_quants(const uint8_t *src, int64_t supers, uint8_t *out) noexcept nogil:
    """Q6_K super-blocks (210 bytes: 128 of low nibbles, 64 of top bit pairs; quant.py's
    _from_q6_k says where value l of each quarter of a half lies) -> eight q6_k blocks of 24
    bytes: q4_1's nibbles, then input j's pair at bits 2 (j / 8) of byte 16 + j % 8."""
    cdef int64_t n
    cdef int half, quarter, j, a
    cdef const uint8_t *ql
    cdef const uint8_t *qh
    cdef uint8_t q[32]
    cdef uint8_t *block
    for n in range(supers):
        for half in range(2):
            ql = src + n * 210 + 64 * half
            qh = src + n * 210 + 128 + 32 * half
            for quarter in range(4):
                for j in range(32):
                    q[j] = ((ql[j + 32 * (quarter & 1)] >> (4 * (quarter >> 1))) & 15) | (
                        ((qh[j] >> (2 * quarter)) & 3) << 4)
                block = out + (4 * half + quarter) * 24
                for j in range(16):
                    block[j] = (q[j] & 15) | ((q[j + 16] & 15) << 4)
                for j in range(8):
                    block[16 + j] = 0
                    for a in range(4):
                        block[16 + j] |= (q[8 * a + j] >> 4) << (2 * a)
        out += 192


def from_gguf(format: str, blocks) -> QuantizedWeight:
    """quant.from_gguf, bit for bit, with the K-quants' quants unpacked by the loops above:
    loading a file's Q4_K / Q5_K / Q6_K tensors in a fraction of the torch twin's time (which
    runs a dozen whole-tensor passes of byte operations, each a fresh allocation)."""
    if format not in ("q4_k", "q5_k", "q6_k"):
        return quant.from_gguf(format, blocks)
    blocks = blocks.contiguous()
    cdef int64_t rows = blocks.shape[0]
    cdef int64_t stride = quant.GGUF_BLOCKS[format][1]
    cdef int64_t supers = blocks.shape[1] // stride * rows
    quants = torch.empty(rows, supers // rows * 8 * LAYOUT_BYTES[quant.LAYOUT_OF[format]], dtype=torch.uint8)
    cdef const uint8_t *src = <const uint8_t *><uintptr_t>blocks.data_ptr()
    cdef uint8_t *out = <uint8_t *><uintptr_t>quants.data_ptr()
    cdef int bits = {"q4_k": 4, "q5_k": 5, "q6_k": 6}[format]
    with nogil:
        if bits == 4:
            _q4_k_quants(src, supers, stride, out)
        elif bits == 5:
            _q5_k_quants(src, supers, out)
        else:
            _q6_k_quants(src, supers, out)
    return _with_k_scales(format, blocks, quants)


def _with_k_scales(format: str, blocks, quants) -> QuantizedWeight:
    """quant.with_scales_of, bit for bit: for Q4_K / Q5_K the fp16 d and dmin converted by torch,
    the 6-bit factors unpacked and multiplied out into the fp32 scales and mins by the loop below
    (Q6_K's signed factors are whole bytes: the twin's own reading of them serves)."""
    if format == "q6_k":
        return quant.with_scales_of(format, blocks, quants)
    cdef int64_t rows = blocks.shape[0]
    cdef int64_t stride = quant.GGUF_BLOCKS[format][1]
    grouped = blocks.reshape(rows, -1, stride)
    cdef int64_t supers = grouped.shape[1] * rows
    d = grouped[..., 0:2].contiguous().view(torch.float16).reshape(rows, -1).float()
    mk = -grouped[..., 2:4].contiguous().view(torch.float16).reshape(rows, -1).float()
    sc = torch.empty(rows, supers // rows * 8, dtype=torch.uint8)
    mn = torch.empty_like(sc)
    scales = torch.empty(rows, supers // rows * 8, dtype=torch.float32)
    mins = torch.empty_like(scales)
    cdef const uint8_t *src = <const uint8_t *><uintptr_t>blocks.data_ptr()
    cdef const float *d_ptr = <const float *><uintptr_t>d.data_ptr()
    cdef const float *mk_ptr = <const float *><uintptr_t>mk.data_ptr()
    cdef uint8_t *sc_ptr = <uint8_t *><uintptr_t>sc.data_ptr()
    cdef uint8_t *mn_ptr = <uint8_t *><uintptr_t>mn.data_ptr()
    cdef float *scales_ptr = <float *><uintptr_t>scales.data_ptr()
    cdef float *mins_ptr = <float *><uintptr_t>mins.data_ptr()
    with nogil:
        _k_scales(src, supers, stride, d_ptr, mk_ptr, sc_ptr, mn_ptr, scales_ptr, mins_ptr)
    return QuantizedWeight(quant.LAYOUT_OF[format], quants, scales, mins, quant.KScales(sc, mn, d, mk))


cdef void _k_scales(const uint8_t *src, int64_t supers, int64_t stride, const float *d, const float *mk,
                    uint8_t *sc, uint8_t *mn, float *scales, float *mins) noexcept nogil:
    """Q4_K / Q5_K super-blocks' 12 bytes at 4 (eight 6-bit scales and eight 6-bit mins: quant.py's
    _k_scales says how they pack) -> each block's factor and min factor, and the fp32 products
    d sc and mk mn (mk = -dmin), exact."""
    cdef int64_t n
    cdef int j
    cdef const uint8_t *p
    for n in range(supers):
        p = src + n * stride + 4
        for j in range(4):
            sc[8 * n + j] = p[j] & 0x3F
            sc[8 * n + 4 + j] = (p[8 + j] & 0x0F) | ((p[j] >> 2) & 0x30)
            mn[8 * n + j] = p[4 + j] & 0x3F
            mn[8 * n + 4 + j] = (p[8 + j] >> 4) | ((p[4 + j] >> 2) & 0x30)
        for j in range(8):
            scales[8 * n + j] = d[n] * <float>sc[8 * n + j]
            mins[8 * n + j] = mk[n] * <float>mn[8 * n + j]


class _TiledLinear:
    """What both linears share: the input's checks and shape, the output, the bias, the
    regrouping of RowSlices. A subclass regroups its weight once and multiplies in
    `_multiply(out, x2)`, which returns the C kernel's code (0, or -1 when out of memory).
    `requantize` makes 8-bit blocks of a format the kernels do not read."""

    def _regroup_by_rows(self, weight: RowSlices) -> None:
        """Become the projection of `weight` (RowSlices), regrouped one slice at a time: every array
        of a regrouped weight is [tiles, ...], rows in tiles of 16 and tiles in row order, so a
        slice of rows regrouped on its own is a range of the whole's tiles. Only one slice's
        blocks are held beside the whole, not the weight's blocks as well as its regrouping."""
        assert weight.step % TILE_N == 0 and weight.out_features % TILE_N == 0, (weight.step, weight.out_features)
        of_slice = type(self)._of_slice
        slices = weight.slices()
        _, part = next(slices)
        first = of_slice(part)  # its holders take the whole's arrays
        del part
        tiled = itertools.chain([(0, first)], ((start, of_slice(part)) for start, part in slices))
        arrays = quant.stacked(((start // TILE_N, [array for _, _, array in _tile_arrays(linear)])
                                for start, linear in tiled), weight.out_features // TILE_N)
        for (holder, name, _), array in zip(list(_tile_arrays(first)), arrays, strict=True):
            setattr(holder, name, array)
            holder.out_features = weight.out_features
        self.__dict__.update(vars(first))
        self.out_features = weight.out_features  # the integer linear's own, beside its part's

    @classmethod
    def _of_slice(cls, part: QuantizedWeight) -> _TiledLinear:
        """The linear of one slice of a weight's rows, whose arrays `_regroup_by_rows` stacks."""
        return cls(part)

    runs = staticmethod(runs)
    layouts = frozenset(FORMATS)  # the layouts of quant.py it multiplies by
    file_formats = frozenset()  # the GGUF formats it takes as FileShards, regrouped straight from the file
    takes_parts = False  # whether it takes QuantizedParts (else quant.cat promotes mixed shards to one layout)
    from_gguf = staticmethod(from_gguf)
    requantize = staticmethod(requantize)

    def __call__(self, x, bias=None, out=None):
        """x [..., K] fp32 on the CPU -> [..., N] fp32; written into `out` ([rows, N] fp32,
        contiguous) when given, a buffer the caller keeps from step to step."""
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] == self.in_features, (x.dtype, x.shape)
        x2 = x.reshape(-1, self.in_features).contiguous()
        if out is None:
            out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        assert out.shape == (x2.shape[0], self.out_features) and out.dtype == torch.float32 and out.is_contiguous()
        if self._multiply(out, x2) != 0:
            raise MemoryError(f"{type(self).__name__}: no memory for the kernel's copy of the rows")
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], self.out_features)


class QuantizedLinear(_TiledLinear):
    """x -> x W^T (+ bias) for one QuantizedWeight with fp32 activations, regrouped once into the
    kernel's tiles."""

    def __init__(self, weight: QuantizedWeight | RowSlices):
        assert runs(weight), (weight.format, weight.out_features)
        if isinstance(weight, RowSlices):
            self._regroup_by_rows(weight)
            return
        self.format = FORMATS[weight.format]
        self.out_features, self.in_features = weight.out_features, weight.in_features
        tiles, blocks = weight.out_features // TILE_N, weight.in_features // BLOCK
        nibbles, fifths = _split_nibbles(weight)
        self.quants, self.scales = _tiled(nibbles, tiles, blocks), _tiled(weight.scales, tiles, blocks)
        self.mins = _tiled(weight.mins, tiles, blocks) if weight.mins is not None else None
        # q5_1: each row's 32-bit word of fifth bits per block, [N / 16, blocks, 1, 16]
        self.highs = None if fifths is None else _tiled(fifths.contiguous().view(torch.int32).reshape(
            weight.out_features, blocks), tiles, blocks)

    def _multiply(self, out, x2) -> int:
        cdef int64_t M = x2.shape[0], K = self.in_features, N = self.out_features
        cdef int fmt = self.format, rc = 0
        cdef float *out_ptr = <float *><uintptr_t>out.data_ptr()
        cdef const float *x_ptr = <const float *><uintptr_t>x2.data_ptr()
        cdef const void *quants_ptr = <const void *><uintptr_t>self.quants.data_ptr()
        cdef const float *scales_ptr = <const float *><uintptr_t>self.scales.data_ptr()
        cdef const float *mins_ptr = <const float *><uintptr_t>(self.mins.data_ptr() if self.mins is not None else 0)
        cdef const uint32_t *highs_ptr = <const uint32_t *><uintptr_t>(
            self.highs.data_ptr() if self.highs is not None else 0)
        cdef int64_t chunks = pool_cpu.chunks()
        with nogil:
            rc = quantized_linear_f32(out_ptr, x_ptr, M, K, N, fmt, quants_ptr, scales_ptr, mins_ptr, highs_ptr,
                                      pool_cpu.run, chunks)
        return rc


class Int8QuantizedLinear(_TiledLinear):
    """x -> x W^T (+ bias) for one QuantizedWeight, or the QuantizedParts of a fused projection
    whose shards keep different layouts, as integer dot products: each row of x is quantized to
    8-bit blocks (quant_int8_cpu.h says how). `isa` picks the kernel's path (one of isas(); the
    widest by default)."""

    runs = staticmethod(int8_runs)
    layouts = frozenset(INT8_BITS)
    file_formats = frozenset(FILE_FORMATS)
    takes_parts = True

    def __init__(self, weight: QuantizedWeight | QuantizedParts | RowSlices | FileShards, isa: str | None = None):
        assert int8_runs(weight), (weight, weight.out_features)
        assert isa is None or isa in isas(), (isa, isas())
        if isinstance(weight, FileShards):
            self.isa = ISAS[isa] if isa is not None else int8_best_isa()
            self.out_features, self.in_features = weight.out_features, weight.in_features
            self.parts = tuple(Int8Part.of_file(run) for run in weight.runs())
        elif isinstance(weight, RowSlices):
            self._regroup_by_rows(weight)
            if isa is not None:
                self.isa = ISAS[isa]
        else:
            self._regroup(weight, isa)
        for part in self.parts:  # on the whole weight: every slice's mins checked
            part.drop_implied_mins()

    def _regroup(self, weight: QuantizedWeight | QuantizedParts, isa: str | None) -> None:
        self.isa = ISAS[isa] if isa is not None else int8_best_isa()
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.parts = tuple(Int8Part(w) for w in (weight.parts if isinstance(weight, QuantizedParts) else (weight,)))
        assert len(self.parts) <= INT8_MAX_PARTS

    @classmethod
    def _of_slice(cls, part: QuantizedWeight) -> Int8QuantizedLinear:
        """A slice's parts with all their arrays, mins included, for the whole to stack."""
        linear = cls.__new__(cls)
        linear._regroup(part, None)
        return linear

    @property
    def bits(self) -> tuple[int, ...]:
        """Each part's layout, in bits (quant_int8_cpu.h)."""
        return tuple(part.bits for part in self.parts)

    def _multiply(self, out, x2) -> int:
        cdef int64_t M = x2.shape[0], K = self.in_features, N = self.out_features
        cdef int isa = self.isa, rc = 0
        cdef float *out_ptr = <float *><uintptr_t>out.data_ptr()
        cdef const float *x_ptr = <const float *><uintptr_t>x2.data_ptr()
        cdef int8_weight w[4]  # INT8_MAX_PARTS
        cdef int parts = int8_weights_of(self, w)
        cdef int64_t chunks = pool_cpu.chunks()
        with nogil:
            rc = int8_linear(out_ptr, x_ptr, M, K, N, w, parts, isa, pool_cpu.run, chunks)
        return rc


def _tile_arrays(linear: _TiledLinear):
    """(holder, attribute, array) for every regrouped array of a linear: its own, or its parts'."""
    for holder in getattr(linear, "parts", (linear,)):
        for name, value in vars(holder).items():
            if isinstance(value, torch.Tensor):
                yield holder, name, value


cdef enum:
    FILE_CHUNK_ROWS = 64  # rows a thread regroups at a time


cdef struct _FileTiles:
    const uint8_t *src  # rows of a file's blocks (super-blocks, or blocks of 32), row_bytes apart
    const float *d  # K-quants: their super-blocks' d, [rows, supers]
    const float *mk  # their -dmin (4 and 5 bits), [rows, supers]
    const int64_t *source  # the row of src each row is, or NULL: its own
    int64_t rows, first, supers, blocks, row_bytes
    int bits
    int m_at, qh_at, qs_at  # blocks of 32 (supers 0): where a block keeps these (BLOCKS_OF_32)
    uint8_t *u  # the part's arrays (Int8Part), written at rows first ..
    uint8_t *h
    uint8_t *sc
    uint8_t *mn
    float *dk
    float *mk_tiled
    uint16_t *dh  # blocks of 32: their fp16 d and m, as the file keeps them
    uint16_t *mh


cdef void _file_tiles_chunk(void *ctx, int64_t chunk) noexcept nogil:
    """Rows FILE_CHUNK_ROWS chunk .. of a _FileTiles job, block by block (a K-quant's super-block
    by super-block): each row's bytes go where Int8Part's torch regrouping puts them (its arrays'
    shapes say where)."""
    cdef _FileTiles *job = <_FileTiles *>ctx
    cdef int64_t i, r, t, s, at, row, b
    cdef int l
    cdef const uint8_t *sb
    for i in range(chunk * FILE_CHUNK_ROWS, min((chunk + 1) * FILE_CHUNK_ROWS, job.rows)):
        row = job.source[i] if job.source != NULL else i
        r = job.first + i
        t, l = r // TILE_N, r % TILE_N
        if job.supers == 0:
            for b in range(job.blocks):
                at = t * job.blocks + b
                _block_tiles(job.src + row * job.row_bytes + b * (job.row_bytes // job.blocks), job,
                             job.u + at * (512 if job.bits == 8 else 256) + l * 4,
                             job.h + at * 64 + l * 4 if job.bits == 5 else NULL, job.dh + at * TILE_N + l,
                             job.mh + at * TILE_N + l if job.m_at >= 0 else NULL)
        for s in range(job.supers):
            sb = job.src + row * job.row_bytes + s * (job.row_bytes // job.supers)
            at = t * job.blocks + 8 * s  # the super-block's first block in the tile
            if job.bits == 6:
                _q6_k_tiles(sb, job.u + at * 256 + l * 4, job.h + at * 128 + l * 4, job.sc + at * 32 + l)
            else:
                _q45_k_tiles(sb, job.bits, job.u + at * 256 + l * 4, job.h + at * 64 + l * 4 if job.bits == 5 else NULL,
                             job.sc + at * 16 + l, job.mn + at * 16 + l)
                job.mk_tiled[(t * job.supers + s) * TILE_N + l] = job.mk[row * job.supers + s]
            job.dk[(t * job.supers + s) * TILE_N + l] = job.d[row * job.supers + s]


cdef inline uint32_t _word(const uint8_t *p) noexcept nogil:
    """The 4 bytes at p (any alignment), byte i in bits 8 i: each byte of a word is worked on
    as its own lane below, with masks that keep bits from crossing into the next one."""
    cdef uint32_t w
    memcpy(&w, p, 4)
    return w


cdef inline void _put(uint8_t *p, uint32_t w) noexcept nogil:
    memcpy(p, &w, 4)


cdef inline void _block_tiles(const uint8_t *block, const _FileTiles *job, uint8_t *u, uint8_t *h, uint16_t *dh,
                              uint16_t *mh) noexcept nogil:
    """A block of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) into one row's place in a tile: u [4 words, or
    Q8_0's 8: 64 apart] of GGUF's bytes as they are (Q8_0's q + 128), the fifth bits' plane h
    (byte c: bit g the fifth bit of input 4 g + c, as _fifth_bit_plane), d and m as they are."""
    cdef int w, g
    cdef uint32_t qh, nibble, plane = 0
    cdef uint32_t flip = (<uint32_t>0x80808080) if job.bits == 8 else 0  # Q8_0's q + 128
    memcpy(dh, block, 2)
    if mh != NULL:
        memcpy(mh, block + job.m_at, 2)
    for w in range(8 if job.bits == 8 else 4):
        _put(u + w * 64, _word(block + job.qs_at + 4 * w) ^ flip)
    if h != NULL:
        qh = _word(block + job.qh_at)  # bit j: input j's fifth bit
        for g in range(8):  # inputs 4 g + c, c = 0..3, to bit g of byte c
            nibble = (qh >> (4 * g)) & 0x0F
            plane |= ((nibble & 1) | ((nibble & 2) << 7) | ((nibble & 4) << 14) | ((nibble & 8) << 21)) << g
        _put(h, plane)


cdef inline void _q45_k_tiles(const uint8_t *sb, int bits, uint8_t *u, uint8_t *h, uint8_t *sc,
                              uint8_t *mn) noexcept nogil:
    """A Q4_K / Q5_K super-block into one row's place in a tile: u [8 blocks: 256 apart][4 words:
    64 apart] of q4_1 nibbles (_q4_k_quants' bytes), Q5_K's plane h [8: 64 apart] (byte c of
    block k: bit g the fifth bit of input 4 g + c, as _fifth_bit_plane), the 6-bit factors sc,
    mn [8: 16 apart] (_k_scales')."""
    cdef const uint8_t *qs = sb + (16 if bits == 4 else 48)
    cdef const uint8_t *qh = sb + 16
    cdef const uint8_t *p = sb + 4
    cdef int c, w, k, g
    cdef uint32_t lo, hi, plane
    for c in range(4):  # 32 bytes: block 2c in their low nibbles, 2c + 1 in their high ones
        for w in range(4):
            lo, hi = _word(qs + 32 * c + 4 * w), _word(qs + 32 * c + 16 + 4 * w)
            _put(u + (2 * c) * 256 + w * 64, (lo & 0x0F0F0F0F) | ((hi & 0x0F0F0F0F) << 4))
            _put(u + (2 * c + 1) * 256 + w * 64, ((lo >> 4) & 0x0F0F0F0F) | (hi & ~(<uint32_t>0x0F0F0F0F)))
    if bits == 5:
        for k in range(8):
            plane = 0
            for g in range(8):
                plane |= ((_word(qh + 4 * g) >> k) & 0x01010101) << g
            _put(h + k * 64, plane)
    for w in range(4):
        sc[w * 16] = p[w] & 0x3F
        sc[(4 + w) * 16] = (p[8 + w] & 0x0F) | ((p[w] >> 2) & 0x30)
        mn[w * 16] = p[4 + w] & 0x3F
        mn[(4 + w) * 16] = (p[8 + w] >> 4) | ((p[4 + w] >> 2) & 0x30)


cdef inline void _q6_k_tiles(const uint8_t *sb, uint8_t *u, uint8_t *h, uint8_t *sc) noexcept nogil:
    """A Q6_K super-block into one row's place in a tile: u as _q45_k_tiles' (the values' low
    nibbles, _q6_k_quants' bytes), the bit-pair planes h [8 blocks: 128 apart][2 planes: 64
    apart] (byte c of plane p: bits 2 g the pair of input 16 p + 4 g + c, as _bit_pair_planes),
    the signed factors sc [8 blocks: 32 apart][2 halves: 16 apart]. Value l of quarter q of a
    half: nibble q / 2 of byte l + 32 (q % 2) of its 64, bit pair q of byte l of its 32."""
    cdef const uint8_t *ql
    cdef const uint8_t *qh
    cdef int half, quarter, k, w, p, g
    cdef uint32_t plane
    for half in range(2):
        ql = sb + 64 * half
        qh = sb + 128 + 32 * half
        for quarter in range(4):
            k = 4 * half + quarter
            for w in range(4):
                _put(u + k * 256 + w * 64,
                     ((_word(ql + 32 * (quarter & 1) + 4 * w) >> (4 * (quarter >> 1))) & 0x0F0F0F0F)
                     | (((_word(ql + 32 * (quarter & 1) + 16 + 4 * w) >> (4 * (quarter >> 1))) & 0x0F0F0F0F) << 4))
            for p in range(2):
                plane = 0
                for g in range(4):
                    plane |= ((_word(qh + 16 * p + 4 * g) >> (2 * quarter)) & 0x03030303) << (2 * g)
                _put(h + k * 128 + p * 64, plane)
            sc[k * 32] = sb[192 + 2 * k]
            sc[k * 32 + 16] = sb[192 + 2 * k + 1]


class Int8Part:
    """One QuantizedWeight regrouped into the integer kernel's tiles: its quants as bytes [N / 16,
    blocks, c, 16, 4] (4 inputs a 32-bit lane), the top bits' planes, the scales as the layout
    keeps them (quant_int8_cpu.h)."""

    def __init__(self, weight: QuantizedWeight):
        self.out_features = weight.out_features
        tiles, blocks = weight.out_features // TILE_N, weight.in_features // BLOCK
        self.bits = INT8_BITS[weight.format]
        self.h = None  # q5_1's plane of fifth bits, q6_k's two of bit pairs
        if self.bits != 8:
            nibbles, top = _split_nibbles(weight)
            self.u = _tiled(nibbles, tiles, blocks, lanes=4)
            if self.bits == 5:
                self.h = _fifth_bit_plane(top, tiles, blocks)
            elif self.bits == 6:
                self.h = _bit_pair_planes(top, tiles, blocks)
        else:  # Q8_0's q as u = q + 128 (the kernel takes the 128 back off)
            self.u = _tiled(weight.quants, tiles, blocks, lanes=4, transform=lambda q: q.view(torch.uint8) ^ 0x80)
        self.d = self.m = self.sc = self.mn = self.dk = self.mk = None
        if self.bits == 6:  # each half block's signed factor [N / 16, blocks, 2, 16], the super-blocks' d
            self.sc = _tiled(weight.k_scales.sc.view(torch.uint8), tiles, blocks)
            self.dk = _tiled(weight.k_scales.d, tiles, blocks // SUPER_BLOCKS)
        elif weight.k_scales is not None:  # the file's own scales, streamed in place of d and m
            k = weight.k_scales
            self.sc, self.mn = _tiled(k.sc, tiles, blocks), _tiled(k.mn, tiles, blocks)
            self.dk, self.mk = _tiled(k.d, tiles, blocks // SUPER_BLOCKS), _tiled(k.mk, tiles, blocks // SUPER_BLOCKS)
        else:  # the scales, and mins where the weight has them (Q4_1, Q5_1, a promoted Q8_0)
            self.d = _tiled(_half_if_exact(weight.scales), tiles, blocks)
            self.m = None if weight.mins is None else _tiled(_half_if_exact(weight.mins), tiles, blocks)
        self.m_of_d = 0.0

    @classmethod
    def of_file(cls, run: tuple[FileBlocks, ...]) -> Int8Part:
        """The part of shards in one of FILE_FORMATS, regrouped from the file's blocks straight
        into the tiles, a shard's `step` rows read at a time (a permuted shard's all at once):
        Int8Part(weight) of the QuantizedWeight they stack into, bit for bit, without making it.
        Runs on the kernels' threads (pool_cpu)."""
        part = cls.__new__(cls)
        file_format, K = run[0].file_format, run[0].in_features
        part.out_features = sum(shard.out_features for shard in run)
        part.bits = FILE_FORMATS[file_format]
        tiles, blocks, supers = part.out_features // TILE_N, K // BLOCK, K // (BLOCK * SUPER_BLOCKS)
        part.u = torch.empty(tiles, blocks, 8 if part.bits == 8 else 4, TILE_N, 4, dtype=torch.uint8)
        part.h = (None if part.bits in (4, 8) else torch.empty(tiles, blocks, TILE_N, 4, dtype=torch.uint8)
                  if part.bits == 5 else torch.empty(tiles, blocks, 2, TILE_N, 4, dtype=torch.uint8))
        part.d = part.m = part.sc = part.mn = part.dk = part.mk = None
        part.m_of_d = 0.0
        if file_format in BLOCKS_OF_32:
            m_at, _, _, part.m_of_d = BLOCKS_OF_32[file_format]
            part.d = torch.empty(tiles, blocks, 1, TILE_N, dtype=torch.float16)
            part.m = torch.empty_like(part.d) if m_at >= 0 else None
        else:
            part.sc = torch.empty(tiles, blocks, 2 if part.bits == 6 else 1, TILE_N, dtype=torch.uint8)
            part.mn = None if part.bits == 6 else torch.empty(tiles, blocks, 1, TILE_N, dtype=torch.uint8)
            part.dk = torch.empty(tiles, supers, 1, TILE_N, dtype=torch.float32)
            part.mk = None if part.bits == 6 else torch.empty_like(part.dk)
        first = 0
        for shard in run:
            assert shard.file_format == file_format and shard.in_features == K, (shard, file_format, K)
            step = shard.out_features if shard.order is not None else shard.step
            for start in range(0, shard.out_features, step):
                with shard.read(slice(start, min(start + step, shard.out_features))) as raw:
                    part._write_file_rows(raw, first + start, shard.order, file_format)
            first += shard.out_features
        return part

    def _write_file_rows(self, raw, first: int, order, file_format: str) -> None:
        """Rows first.. of the tiles from raw blocks of `file_format` [rows, bytes of a row] (numpy
        uint8, C order; its row order[i] becomes row first + i where `order` is given)."""
        cdef _FileTiles job
        rows, stride = raw.shape[0], quant.GGUF_BLOCKS[file_format][1]
        assert raw.dtype == np.uint8 and raw.flags.c_contiguous and raw.shape[1] % stride == 0, (raw.dtype, raw.shape)
        d = mk = None
        job.supers, job.blocks, job.m_at, job.qh_at, job.qs_at = 0, raw.shape[1] // stride, -1, -1, 0
        if file_format in BLOCKS_OF_32:
            job.m_at, job.qh_at, job.qs_at, _ = BLOCKS_OF_32[file_format]
        else:  # the super-blocks' d and -dmin, widened here
            grouped = raw.reshape(rows, -1, stride)
            at = 208 if self.bits == 6 else 0
            d = np.ascontiguousarray(grouped[..., at : at + 2]).view(np.float16).reshape(rows, -1).astype(np.float32)
            mk = None if self.bits == 6 else -np.ascontiguousarray(grouped[..., 2:4]).view(np.float16).reshape(
                rows, -1).astype(np.float32)
            job.supers, job.blocks = d.shape[1], d.shape[1] * 8
        source = None if order is None else np.ascontiguousarray(order.numpy(), dtype=np.int64)
        # every row it names inside raw: the loop below reads them unchecked
        assert source is None or (source.shape == (rows,) and 0 <= source.min() and source.max() < rows), rows
        job.src = <const uint8_t *><uintptr_t>raw.ctypes.data
        job.d = <const float *><uintptr_t>(d.ctypes.data if d is not None else 0)
        job.mk = <const float *><uintptr_t>(mk.ctypes.data if mk is not None else 0)
        job.source = <const int64_t *><uintptr_t>(source.ctypes.data if source is not None else 0)
        job.rows, job.first, job.bits, job.row_bytes = rows, first, self.bits, raw.shape[1]
        job.u = <uint8_t *><uintptr_t>self.u.data_ptr()
        job.h = <uint8_t *><uintptr_t>(self.h.data_ptr() if self.h is not None else 0)
        job.sc = <uint8_t *><uintptr_t>(self.sc.data_ptr() if self.sc is not None else 0)
        job.mn = <uint8_t *><uintptr_t>(self.mn.data_ptr() if self.mn is not None else 0)
        job.dk = <float *><uintptr_t>(self.dk.data_ptr() if self.dk is not None else 0)
        job.mk_tiled = <float *><uintptr_t>(self.mk.data_ptr() if self.mk is not None else 0)
        job.dh = <uint16_t *><uintptr_t>(self.d.data_ptr() if self.d is not None else 0)
        job.mh = <uint16_t *><uintptr_t>(self.m.data_ptr() if self.m is not None else 0)
        cdef int64_t chunks = (rows + FILE_CHUNK_ROWS - 1) // FILE_CHUNK_ROWS
        with nogil:
            pool_cpu.run(_file_tiles_chunk, &job, chunks)

    def drop_implied_mins(self) -> None:
        """Q4_0's and Q5_0's mins, -8 d and -16 d (quant.from_gguf): dropped, the kernel makes the
        same products from d (`m_of_d`). Run on the whole weight, once its slices are stacked
        (`_of_slice` keeps each slice's), so that every slice's mins are checked."""
        if self.m is None or self.d is None:
            return
        for m_of_d in (-8.0, -16.0):
            if torch.equal(self.m.float(), self.d.float() * m_of_d):
                self.m, self.m_of_d = None, m_of_d
                return


def _half_if_exact(array):
    """An fp32 array as fp16 where every value is exactly an fp16 one, as a file's block scales
    are (the kernel widens them in registers: half the bytes a decode step streams for them);
    else as it is."""
    half = array.half()
    return half if torch.equal(half.float(), array) else array


def _bit_pair_planes(pairs, tiles: int, blocks: int):
    """[N, blocks, 8] bytes of bit pairs (input j's at bits 2 (j / 8) of byte j % 8) -> the integer
    kernel's planes [N / 16, blocks, 2, 16, 4]: bits 2 g' of the byte of row i and column c in
    plane p hold the pair of input 16 p + 4 g' + c, the value register 4 p + g' of unpacked
    nibbles holds in that byte. Each row's bytes are reordered by the loop below, then its
    words regrouped into tiles."""
    pairs = pairs.contiguous()
    by_row = torch.empty_like(pairs)
    cdef int64_t n = pairs.numel() // 8
    cdef const uint8_t *src = <const uint8_t *><uintptr_t>pairs.data_ptr()
    cdef uint8_t *out = <uint8_t *><uintptr_t>by_row.data_ptr()
    with nogil:
        _pair_planes(src, n, out)
    return _tiled(by_row.reshape(pairs.shape[0], -1), tiles, blocks, lanes=4)


cdef void _pair_planes(const uint8_t *src, int64_t n, uint8_t *out) noexcept nogil:
    """n blocks' 8 bytes of bit pairs -> each block's planes, byte 4 p + c (p, c as above)."""
    cdef int64_t k
    cdef int p, c, g, j
    cdef uint8_t byte
    for k in range(n):
        for p in range(2):
            for c in range(4):
                byte = 0
                for g in range(4):
                    j = 16 * p + 4 * g + c
                    byte |= ((src[j % 8] >> (2 * (j // 8))) & 3) << (2 * g)
                out[4 * p + c] = byte
        src += 8
        out += 8


def _fifth_bit_plane(fifths, tiles: int, blocks: int):
    """[N, blocks, 4] bytes of fifth bits (bit j of a block's word input j's) -> the integer
    kernel's plane [N / 16, blocks, 16, 4]: bit g of the byte of row i and column c is the fifth
    bit of input 4 g + c (g < 4) or 16 + 4 (g - 4) + c, the value the g-th register of unpacked
    nibbles holds in that byte."""
    rows = fifths.shape[0]
    bit = (fifths[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [N, blocks, 32]: input j's bit
    by_group = bit.reshape(rows, blocks, 2, 4, 4)  # [.., low or high nibbles, group within, column c]
    by_group = by_group.reshape(rows, blocks, 8, 4)  # g = 4 * (j >= 16) + (j % 16) / 4
    plane = (by_group << torch.arange(8, dtype=torch.uint8)[:, None]).sum(2, dtype=torch.uint8)  # [N, blocks, 4]
    return plane.reshape(tiles, TILE_N, blocks, 4).permute(0, 2, 1, 3).contiguous()
