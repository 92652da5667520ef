"""GGUF's quantized weights, kept quantized: their layout for the kernels, and the torch twin.

Why keep them: a decode step on CPU costs about the time it takes to stream every weight once, and
these formats are 4.5 to 8.5 bits a weight against fp32's 32 (trillm/kernels/quant_cpu.h
multiplies by them directly). The twin dequantizes exactly as gguf-py does, so a dequantized
weight equals the one transformers loads from the file.

Three layouts, named after the GGUF formats they come from, hold every format read here: "q4_1",
blocks of 32 unsigned 4-bit quants with an fp32 scale d and min m each (w = d q + m); "q5_1", the
same with a fifth bit per quant (q = 0..31); "q8_0", blocks of 32 signed 8-bit quants with a scale
each (w = d q, or d q + m where it keeps mins: `cat` promotes a fused projection's q4_1 and q5_1
shards to it, exactly, when another shard is q8_0, so that the whole projection runs on the
kernels as one). A file's formats are repacked into them at load, exactly (the products of fp16
scales and 6-bit sub-block scales fit fp32's mantissa, so w comes out bit for bit as gguf-py
computes it):
- Q4_1, Q5_1 and Q8_0 as they are;
- Q4_0 (w = d (q - 8)) as q4_1 with m = -8 d, Q5_0 (w = d (q - 16)) as q5_1 with m = -16 d;
- Q4_K and Q5_K (super-blocks of 256: eight sub-blocks of 32, each w = d sc q - dmin mn, sc and
  mn 6-bit) as q4_1 and q5_1, each sub-block a block with d = d sc and m = -dmin mn.
Q6_K (16-value sub-blocks with their own scales) and the other formats fit none of them exactly:
`requantize` makes q8_0 blocks of their dequantized values, 8 bits a weight where the file's were
2 to 6, each within half a step of 1/127 of its block's largest magnitude (a step several times
finer than the file's own). trillm/model/gguf_weights.py logs which were.

Layout in memory: quants, q4_1 [N, K / 2] uint8 (a block's 16 bytes hold input j in the low
nibble and j + 16 in the high one), q5_1 [N, K / 32 * 20] uint8 (a block's 16 bytes of nibbles as
q4_1's, then 4 bytes, a little-endian 32-bit word whose bit j is input j's fifth bit, as GGUF
keeps them) or q8_0 [N, K] int8; scales and mins [N, K / 32] fp32 (the kernel converts nothing).
A weight from Q4_K or Q5_K blocks also keeps those scales in their own form (`KScales`: each
block's 6-bit factors and each super-block's d and dmin), which the integer kernel streams
instead of the fp32 ones: 3 bytes a block and row where those take 8.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

BLOCK = 32
# format read from a file -> (values, bytes) of one of its GGUF blocks
GGUF_BLOCKS = {"q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
               "q4_k": (256, 144), "q5_k": (256, 176)}
# bytes of a block of 32 in each layout's quants
LAYOUT_BYTES = {"q4_1": BLOCK // 2, "q5_1": BLOCK // 2 + 4, "q8_0": BLOCK}


SUPER_BLOCKS = 8  # blocks of 32 in a K-quant super-block of 256


class KScales(NamedTuple):
    """A K-quant weight's block scales as the file keeps them: block b of row n has scale
    d[n, b / 8] * sc[n, b] and min mk[n, b / 8] * mn[n, b] (mk = -dmin), each product exact in fp32."""

    sc: torch.Tensor  # [N, K / 32] uint8, 0..63
    mn: torch.Tensor  # [N, K / 32] uint8, 0..63
    d: torch.Tensor  # [N, K / 256] fp32
    mk: torch.Tensor  # [N, K / 256] fp32

    def rows(self, index: torch.Tensor | slice) -> KScales:
        return KScales(*(t[index] for t in self))

    def expanded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-block scale d sc and min mk mn, both [N, K / 32] fp32 (exact: 11 by 6 bits)."""
        d = self.d.repeat_interleave(SUPER_BLOCKS, dim=1)
        mk = self.mk.repeat_interleave(SUPER_BLOCKS, dim=1)
        return d * self.sc.float(), mk * self.mn.float()


class QuantizedWeight(NamedTuple):
    format: str  # the layout: "q4_1" | "q5_1" | "q8_0"
    quants: torch.Tensor  # q4_1: [N, K / 2] uint8; q5_1: [N, K / 32 * 20] uint8; q8_0: [N, K] int8
    scales: torch.Tensor  # [N, K / 32] fp32
    mins: torch.Tensor | None  # q4_1, q5_1, a promoted q8_0: [N, K / 32] fp32
    k_scales: KScales | None = None  # from Q4_K / Q5_K blocks: scales and mins in the file's own form

    @property
    def out_features(self) -> int:
        return self.scales.shape[0]

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * BLOCK

    def columns(self, start: int, end: int) -> QuantizedWeight:
        """Input columns [start, end), which must fall on block boundaries (a row-parallel shard)."""
        assert start % BLOCK == 0 and end % BLOCK == 0, f"columns {start}:{end} split a {BLOCK}-wide block"
        per_block = LAYOUT_BYTES[self.format]
        blocks = slice(start // BLOCK, end // BLOCK)
        k_scales = None
        if self.k_scales is not None and blocks.start % SUPER_BLOCKS == 0 and blocks.stop % SUPER_BLOCKS == 0:
            supers = slice(blocks.start // SUPER_BLOCKS, blocks.stop // SUPER_BLOCKS)
            k_scales = KScales(self.k_scales.sc[:, blocks].contiguous(), self.k_scales.mn[:, blocks].contiguous(),
                               self.k_scales.d[:, supers].contiguous(), self.k_scales.mk[:, supers].contiguous())
        return QuantizedWeight(
            self.format, self.quants[:, blocks.start * per_block : blocks.stop * per_block].contiguous(),
            self.scales[:, blocks].contiguous(), None if self.mins is None else self.mins[:, blocks].contiguous(),
            k_scales,
        )

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The weight of some output rows (a reordering, a shard): blocks never span two rows."""
        return QuantizedWeight(
            self.format, self.quants[index], self.scales[index], None if self.mins is None else self.mins[index],
            None if self.k_scales is None else self.k_scales.rows(index),
        )


def from_gguf(format: str, blocks: torch.Tensor) -> QuantizedWeight:
    """blocks: a GGUF tensor's raw bytes in `format` (a GGUF_BLOCKS key), [N, bytes of a row] uint8."""
    assert format in GGUF_BLOCKS and blocks.dtype == torch.uint8 and blocks.dim() == 2, (format, blocks.shape)
    rows = blocks.shape[0]
    blocks = blocks.reshape(rows, -1, GGUF_BLOCKS[format][1])

    def fp16_at(offset: int) -> torch.Tensor:
        return blocks[..., offset : offset + 2].contiguous().view(torch.float16).reshape(rows, -1).float()

    if format == "q4_1":
        return QuantizedWeight("q4_1", blocks[..., 4:].reshape(rows, -1).contiguous(), fp16_at(0), fp16_at(2))
    if format == "q4_0":
        d = fp16_at(0)
        return QuantizedWeight("q4_1", blocks[..., 2:].reshape(rows, -1).contiguous(), d, d * -8.0)
    if format == "q8_0":
        return QuantizedWeight("q8_0", blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1), fp16_at(0),
                               None)
    if format == "q5_0":
        d = fp16_at(0)
        return QuantizedWeight("q5_1", _q5_quants(blocks[..., 6:], blocks[..., 2:6], rows), d, d * -16.0)
    if format == "q5_1":
        return QuantizedWeight("q5_1", _q5_quants(blocks[..., 8:], blocks[..., 4:8], rows), fp16_at(0), fp16_at(2))
    k_scales = _k_scales(blocks, fp16_at(0), fp16_at(2))
    scales, mins = k_scales.expanded()
    if format == "q4_k":
        pairs = blocks[..., 16:].reshape(rows, -1, 4, 1, BLOCK)
        q = torch.cat((pairs & 15, pairs >> 4), dim=3).reshape(rows, -1, BLOCK)  # sub-blocks in order
        return QuantizedWeight("q4_1", (q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)).reshape(rows, -1).contiguous(),
                               scales, mins, k_scales)
    # q5_k: the low nibbles as Q4_K's, after 32 bytes whose bit s of byte l is the fifth bit of
    # value l of sub-block s
    pairs = blocks[..., 48:].reshape(rows, -1, 4, 1, BLOCK)
    low = torch.cat((pairs & 15, pairs >> 4), dim=3).reshape(rows, -1, 8, BLOCK)
    fifth = (blocks[..., 16:48].reshape(rows, -1, 1, BLOCK) >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    q = (low | (fifth << 4)).reshape(rows, -1, BLOCK)
    return QuantizedWeight("q5_1", _pack_q5(q).reshape(rows, -1), scales, mins, k_scales)


def _q5_quants(nibbles: torch.Tensor, high: torch.Tensor, rows: int) -> torch.Tensor:
    """A q5_1 layout's quants from GGUF's Q5_0 / Q5_1 blocks, whose nibbles and fifth bits are
    already in it, only in the other order."""
    return torch.cat((nibbles, high), dim=-1).reshape(rows, -1).contiguous()


def _pack_q5(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] values 0..31 (uint8) -> [..., 20] bytes of the q5_1 layout."""
    nibbles = (q[..., : BLOCK // 2] & 15) | ((q[..., BLOCK // 2 :] & 15) << 4)
    fifth = (q >> 4).reshape(*q.shape[:-1], 4, 8) << torch.arange(8, dtype=torch.uint8)
    return torch.cat((nibbles, fifth.sum(-1, dtype=torch.uint8)), dim=-1)  # distinct bits: the sum is an OR


def _k_scales(blocks: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> KScales:
    """The scales of Q4_K / Q5_K super-blocks [N, K / 256, bytes]: the 12 bytes after d and dmin
    hold eight 6-bit scales and eight 6-bit mins."""
    rows, supers = blocks.shape[:2]
    packed = blocks[..., 4:16].reshape(rows, supers, 3, 4)
    low6, mins_low6, high = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    scales = torch.cat((low6 & 0x3F, (high & 0x0F) | ((low6 >> 2) & 0x30)), dim=-1)
    mins = torch.cat((mins_low6 & 0x3F, (high >> 4) | ((mins_low6 >> 2) & 0x30)), dim=-1)
    return KScales(scales.reshape(rows, -1).contiguous(), mins.reshape(rows, -1).contiguous(), d.contiguous(),
                   -dmin)



def requantize(weight: torch.Tensor) -> QuantizedWeight:
    """An fp32 [N, K] weight (K a multiple of 32) as q8_0 blocks, quantized as activations are
    (quantize_rows): d = max|w| / 127 per block, q = round(w / d), so |d q - w| <= d / 2."""
    return weight_of_rows(quantize_rows(weight.float()))


def weight_of_rows(rows: QuantizedRows) -> QuantizedWeight:
    """A weight's rows quantized as activations are, as a q8_0 weight (d = e)."""
    return QuantizedWeight("q8_0", rows.v, rows.e, None)


def cat(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stacks the rows of weights (a fused projection's shards); where their layouts differ, all
    become q8_0 with mins first (`as_bytes`), which holds each exactly. K-quant files mix formats
    within a projection (llama-quantize gives some layers' v more bits than their q and k)."""
    if len({w.format for w in weights}) > 1:
        weights = [as_bytes(w) for w in weights]
    if any(w.mins is not None for w in weights):
        weights = [w if w.mins is not None else w._replace(mins=torch.zeros_like(w.scales)) for w in weights]
    mins = None if weights[0].mins is None else torch.cat([w.mins for w in weights])
    k_scales = None  # kept where every shard has them; otherwise the fp32 ones serve
    if all(w.k_scales is not None for w in weights):
        k_scales = KScales(*(torch.cat(parts) for parts in zip(*(w.k_scales for w in weights))))
    return QuantizedWeight(
        weights[0].format, torch.cat([w.quants for w in weights]), torch.cat([w.scales for w in weights]), mins,
        k_scales,
    )


def as_bytes(weight: QuantizedWeight) -> QuantizedWeight:
    """The same weight in the q8_0 layout, exactly: a q4_1 or q5_1 quant u (0..31) is the byte u,
    under the same scale and min."""
    if weight.format == "q8_0":
        return weight
    return QuantizedWeight("q8_0", block_quants(weight).to(torch.int8).reshape(weight.out_features, -1),
                           weight.scales, weight.mins, weight.k_scales)


def block_quants(weight: QuantizedWeight) -> torch.Tensor:
    """[N, K / 32, 32]: each block's integer quants in input order (q4_1: 0..15 uint8, its nibbles
    unpacked; q5_1: 0..31 uint8; q8_0: int8)."""
    rows, blocks = weight.scales.shape
    if weight.format == "q8_0":
        return weight.quants.reshape(rows, blocks, BLOCK)
    packed = weight.quants.reshape(rows, blocks, LAYOUT_BYTES[weight.format])
    q = torch.cat((packed[..., : BLOCK // 2] & 15, packed[..., : BLOCK // 2] >> 4), dim=-1)
    if weight.format == "q5_1":
        high = packed[..., BLOCK // 2 :, None] >> torch.arange(8, dtype=torch.uint8)  # [.., 4 bytes, 8 bits]
        q |= (high.reshape(rows, blocks, BLOCK) & 1) << 4
    return q


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """[N, K] fp32, bit for bit what gguf-py (and so transformers) makes of the same blocks."""
    rows, blocks = weight.scales.shape
    w = weight.scales[..., None] * block_quants(weight).float()
    if weight.mins is not None:
        w = w + weight.mins[..., None]
    return w.reshape(rows, blocks * BLOCK)


def linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The twin of quant_cpu.QuantizedLinear: x W^T (+ b) on the dequantized weight."""
    return F.linear(x, dequantize(weight), bias)


class QuantizedRows(NamedTuple):
    """Activations in 8-bit blocks of 32 (llama.cpp's Q8_1): x ~ e * v per block, s = e * sum(v)."""

    v: torch.Tensor  # [M, K] int8, -127..127
    e: torch.Tensor  # [M, K / 32] fp32
    s: torch.Tensor  # [M, K / 32] fp32


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """x [M, K] fp32 -> its blocks, as trillm/kernels/quant_int8_cpu.h makes them, bit for bit:
    e = max|x| / 127, v = round-half-even(x * (1 / e)), 0 where e is 0."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // BLOCK, BLOCK)
    e = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(e != 0, 1.0 / e, torch.zeros_like(e))
    v = torch.round(blocks * inv[..., None]).to(torch.int8)
    s = e * v.sum(dim=-1, dtype=torch.int32).float()
    return QuantizedRows(v.reshape(rows, k), e, s)


def linear_int8(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The twin of quant_cpu.Int8QuantizedLinear: x's rows quantized by `quantize_rows`, then per
    block of 32 inputs d e sum(q v) + m s (q8_0 without mins: the exact d e sum(q v)), in float64 so that
    only the kernel's fp32 sums differ from it."""
    shape = x.shape
    rows = quantize_rows(x.reshape(-1, shape[-1]).float())
    n, blocks = weight.scales.shape
    v = rows.v.reshape(-1, blocks, BLOCK)
    dots = torch.einsum("mbk,nbk->mnb", v.double(), block_quants(weight).double())  # exact: integers below 2^53
    y = (dots * weight.scales.double()[None] * rows.e.double()[:, None]).sum(-1)
    if weight.mins is not None:
        y += rows.s.double() @ weight.mins.double().T
    y = y.float()
    if bias is not None:
        y += bias
    return y.reshape(*shape[:-1], n)
