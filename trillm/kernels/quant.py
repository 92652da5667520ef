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
A fourth layout, "q6_k", keeps Q6_K's own arithmetic, which none of those hold exactly: blocks of
32 unsigned 6-bit quants, each block two sub-blocks of 16 with a scale each (w = s (q - 32)), the
scale the product of the super-block's fp16 d and the sub-block's signed 8-bit factor (exact in
fp32). The integer kernel streams it in the file's bits (Q4_K_M and Q5_K_M files keep their
vocabulary projection and half their layers' v and down projections in it); the fp32 kernel and
a fused projection whose shards mix it with another layout get q8_0 blocks of its values instead.
The other formats fit none of the layouts: `requantize` makes q8_0 blocks of their dequantized
values, 8 bits a weight where the file's were 2 to 6, each within half a step of 1/127 of its
block's largest magnitude (a step several times finer than the file's own).
trillm/model/gguf_weights.py logs which were.

Layout in memory: quants, q4_1 [N, K / 2] uint8 (a block's 16 bytes hold input j in the low
nibble and j + 16 in the high one), q5_1 [N, K / 32 * 20] uint8 (a block's 16 bytes of nibbles as
q4_1's, then 4 bytes, a little-endian 32-bit word whose bit j is input j's fifth bit, as GGUF
keeps them) or q8_0 [N, K] int8; scales and mins [N, K / 32] fp32 (the integer kernel keeps them in
fp16 where they are fp16 values, as a file's are). q6_k [N, K / 32 * 24] uint8: a block's 16 bytes
of low nibbles as q4_1's, then 8 bytes of the quants' top two bits (input j's at bits 2 (j / 8)
of byte j % 8); scales [N, K / 16] fp32, no mins.
A weight from Q4_K or Q5_K blocks also keeps those scales in their own form (`KScales`: each
block's 6-bit factors and each super-block's d and dmin), which the integer kernel streams
instead of the fp32 ones: 3 bytes a block and row where those take 8.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

BLOCK = 32
# format read from a file -> (values, bytes) of one of its GGUF blocks
GGUF_BLOCKS = {"q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
               "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}
# format read from a file -> the layout it is repacked into
LAYOUT_OF = {"q4_0": "q4_1", "q4_1": "q4_1", "q5_0": "q5_1", "q5_1": "q5_1", "q8_0": "q8_0", "q4_k": "q4_1",
             "q5_k": "q5_1", "q6_k": "q6_k"}
# bytes of a block of 32 in each layout's quants
LAYOUT_BYTES = {"q4_1": BLOCK // 2, "q5_1": BLOCK // 2 + 4, "q8_0": BLOCK, "q6_k": BLOCK // 2 + 8}
SUB_BLOCK = 16  # inputs under one scale in the q6_k layout
Q6_OFFSET = 32  # q6_k's w = s (q - 32)


SUPER_BLOCKS = 8  # blocks of 32 in a K-quant super-block of 256


class KScales(NamedTuple):
    """A K-quant weight's block scales as the file keeps them: block b of row n has scale
    d[n, b / 8] * sc[n, b] and min mk[n, b / 8] * mn[n, b] (mk = -dmin), each product exact in fp32.
    A q6_k weight's: sub-block j of row n has scale d[n, j / 16] * sc[n, j] (sc signed, no mins)."""

    sc: torch.Tensor  # [N, K / 32] uint8, 0..63; q6_k: [N, K / 16] int8
    mn: torch.Tensor | None  # [N, K / 32] uint8, 0..63; q6_k: None
    d: torch.Tensor  # [N, K / 256] fp32
    mk: torch.Tensor | None  # [N, K / 256] fp32; q6_k: None

    def rows(self, index: torch.Tensor | slice) -> KScales:
        return KScales(*(None if t is None else t[index] for t in self))

    def expanded(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The per-block scale d sc and min mk mn (exact: 11 by 6 or 8 bits), [N, K / 32] fp32
        each; q6_k's per-sub-block scales [N, K / 16] and no mins."""
        d = self.d.repeat_interleave(self.sc.shape[1] // self.d.shape[1], dim=1)
        if self.mn is None:
            return d * self.sc.float(), None
        return d * self.sc.float(), self.mk.repeat_interleave(SUPER_BLOCKS, dim=1) * self.mn.float()


class QuantizedWeight(NamedTuple):
    format: str  # the layout: "q4_1" | "q5_1" | "q8_0" | "q6_k"
    # q4_1: [N, K / 2] uint8; q5_1: [N, K / 32 * 20] uint8; q8_0: [N, K] int8; q6_k: [N, K / 32 * 24] uint8
    quants: torch.Tensor
    scales: torch.Tensor  # [N, K / 32] fp32; q6_k: [N, K / 16]
    mins: torch.Tensor | None  # q4_1, q5_1, a promoted q8_0: [N, K / 32] fp32
    # from Q4_K / Q5_K / Q6_K blocks: the scales (and mins) in the file's own form
    k_scales: KScales | None = None

    @property
    def out_features(self) -> int:
        return self.quants.shape[0]

    @property
    def in_features(self) -> int:
        return self.quants.shape[1] // LAYOUT_BYTES[self.format] * BLOCK

    def columns(self, start: int, end: int) -> QuantizedWeight:
        """Input columns [start, end), which must fall on block boundaries (a row-parallel shard;
        a q6_k weight's on super-blocks too, or it becomes q8_0 blocks of its values)."""
        assert start % BLOCK == 0 and end % BLOCK == 0, f"columns {start}:{end} split a {BLOCK}-wide block"
        per_block = LAYOUT_BYTES[self.format]
        blocks = slice(start // BLOCK, end // BLOCK)
        whole_supers = blocks.start % SUPER_BLOCKS == 0 and blocks.stop % SUPER_BLOCKS == 0
        if self.format == "q6_k" and not whole_supers:
            return requantize(dequantize(self)[:, start:end])
        per_scale = slice(start // SUB_BLOCK, end // SUB_BLOCK) if self.format == "q6_k" else blocks
        k_scales = None
        if self.k_scales is not None and whole_supers:
            supers = slice(blocks.start // SUPER_BLOCKS, blocks.stop // SUPER_BLOCKS)
            k = self.k_scales
            k_scales = KScales(k.sc[:, per_scale].contiguous(), None if k.mn is None else k.mn[:, blocks].contiguous(),
                               k.d[:, supers].contiguous(), None if k.mk is None else k.mk[:, supers].contiguous())
        return QuantizedWeight(
            self.format, self.quants[:, blocks.start * per_block : blocks.stop * per_block].contiguous(),
            self.scales[:, per_scale].contiguous(), None if self.mins is None else self.mins[:, blocks].contiguous(),
            k_scales,
        )

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The weight of some output rows (a reordering, a shard): blocks never span two rows."""
        return QuantizedWeight(
            self.format, self.quants[index], self.scales[index], None if self.mins is None else self.mins[index],
            None if self.k_scales is None else self.k_scales.rows(index),
        )


class RowSlices(NamedTuple):
    """A weight too large to hold twice (a vocabulary projection) as its rows come: `slice_of(rows)`
    makes the QuantizedWeight of a slice of rows, `step` rows at a time. A kernel that regroups
    weights into a layout of its own takes it slice by slice, so that only one slice's blocks are
    held beside its regrouped whole; anything else takes `whole()`."""

    format: str  # the layout each slice has
    out_features: int
    in_features: int
    slice_of: Callable[[slice], QuantizedWeight]
    step: int

    def slices(self) -> Iterator[tuple[int, QuantizedWeight]]:
        """(first row, the slice's weight), in order."""
        for start in range(0, self.out_features, self.step):
            part = self.slice_of(slice(start, min(start + self.step, self.out_features)))
            assert part.format == self.format and part.in_features == self.in_features, (part.format, self.format)
            yield start, part

    def whole(self) -> QuantizedWeight:
        """The weight, its slices written into one: the conversion's intermediate arrays stay a
        slice's size whatever the weight's."""
        slices = self.slices()
        _, first = next(slices)
        if first.out_features == self.out_features:
            return first
        parts = itertools.chain([(0, first)], slices)
        return _with_arrays(first, stacked(((start, _arrays(part)) for start, part in parts), self.out_features))

    def rows(self, index: slice) -> RowSlices:
        """The rows of a contiguous range (a rank's shard), still by slices."""
        start, stop, stride = index.indices(self.out_features)
        assert stride == 1, "a shard is a contiguous range of rows"
        return self._replace(out_features=stop - start,
                             slice_of=lambda rows: self.slice_of(slice(start + rows.start, start + rows.stop)))


def stacked(parts: Iterable[tuple[int, list[torch.Tensor | None]]], rows: int) -> list[torch.Tensor | None]:
    """Arrays of `rows` rows, each [rows, ...], from parts that come one at a time as (first
    row, the part's arrays): shaped as the first part's (None where it has None), typed as the
    widest part's (a kernel keeps a part's scales in fp16 where they all are fp16 values, and a
    later part's may not be), each part written where it starts. Lazy parts keep one beside the
    whole, never all of them."""
    whole = None
    for start, arrays in parts:
        if whole is None:
            whole = [None if a is None else a.new_empty((rows, *a.shape[1:])) for a in arrays]
        for i, (into, part) in enumerate(zip(whole, arrays, strict=True)):
            if into is None:
                continue
            widest = torch.promote_types(into.dtype, part.dtype)
            if widest != into.dtype:  # exact: the rows written so far fit the narrower type
                whole[i] = into = into.to(widest)
            into[start : start + part.shape[0]] = part
    return whole


def _arrays(weight: QuantizedWeight) -> list[torch.Tensor | None]:
    """Every array of the weight, each [rows, ...]: quants, scales, mins, then the K scales'."""
    return [weight.quants, weight.scales, weight.mins, *(weight.k_scales or (None,) * len(KScales._fields))]


def _with_arrays(weight: QuantizedWeight, arrays: list[torch.Tensor | None]) -> QuantizedWeight:
    quants, scales, mins, *k_scales = arrays
    return weight._replace(quants=quants, scales=scales, mins=mins,
                           k_scales=None if k_scales[0] is None else KScales(*k_scales))


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
    return with_scales_of(format, blocks, _k_quants(format, blocks))


def _k_quants(format: str, blocks: torch.Tensor) -> torch.Tensor:
    """The quants of K-quant super-blocks [N, K / 256, bytes] in their layout, [N, K / 32 * bytes
    of a block]."""
    rows = blocks.shape[0]
    if format == "q6_k":
        return _pack_q6(_q6_k_values(blocks)).reshape(rows, -1)
    if format == "q4_k":
        pairs = blocks[..., 16:].reshape(rows, -1, 4, 1, BLOCK)
        q = torch.cat((pairs & 15, pairs >> 4), dim=3).reshape(rows, -1, BLOCK)  # sub-blocks in order
        return (q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)).reshape(rows, -1).contiguous()
    # q5_k: the low nibbles as Q4_K's, after 32 bytes whose bit s of byte l is the fifth bit of
    # value l of sub-block s
    pairs = blocks[..., 48:].reshape(rows, -1, 4, 1, BLOCK)
    low = torch.cat((pairs & 15, pairs >> 4), dim=3).reshape(rows, -1, 8, BLOCK)
    fifth = (blocks[..., 16:48].reshape(rows, -1, 1, BLOCK) >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    return _pack_q5((low | (fifth << 4)).reshape(rows, -1, BLOCK)).reshape(rows, -1)


def with_scales_of(format: str, blocks: torch.Tensor, quants: torch.Tensor) -> QuantizedWeight:
    """The weight of K-quant blocks [N, bytes of a row] (a GGUF_BLOCKS key), their quants already
    in its layout (`_k_quants`, or the kernels' own twin of it): the scales read here."""
    rows = blocks.shape[0]
    blocks = blocks.reshape(rows, -1, GGUF_BLOCKS[format][1])
    if format == "q6_k":
        d = blocks[..., 208:210].contiguous().view(torch.float16).reshape(rows, -1).float()
        k_scales = KScales(blocks[..., 192:208].contiguous().view(torch.int8).reshape(rows, -1), None, d, None)
        return QuantizedWeight("q6_k", quants, k_scales.expanded()[0], None, k_scales)
    d, dmin = (blocks[..., at : at + 2].contiguous().view(torch.float16).reshape(rows, -1).float() for at in (0, 2))
    k_scales = _k_scales(blocks, d, dmin)
    return QuantizedWeight(LAYOUT_OF[format], quants, *k_scales.expanded(), k_scales)


def _q6_k_values(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks [N, K / 256, 210] (128 bytes of low nibbles, 64 of top bit pairs, 16
    signed 8-bit sub-block scales, an fp16 d) -> their quants [N, K / 32, 32], 0..63, in order.
    Each half of 128 values keeps value l (< 32) of its four quarters in nibble and bit pair:
    quarter 0 low nibble of byte l, bits 0-1 of pair byte l; quarter 1 low nibble of byte l + 32,
    bits 2-3; quarter 2 high nibble of byte l, bits 4-5; quarter 3 high nibble of byte l + 32,
    bits 6-7."""
    rows, supers = blocks.shape[:2]
    low = blocks[..., :128].reshape(rows, supers, 2, 2, 32)  # [.., half, byte l or l + 32, l]
    high = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32)
    nibbles = torch.stack((low[..., 0, :] & 15, low[..., 1, :] & 15, low[..., 0, :] >> 4, low[..., 1, :] >> 4), -2)
    pairs = (high >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3  # [.., half, quarter, l]
    return (nibbles | (pairs << 4)).reshape(rows, -1, BLOCK)


def _pack_q6(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] values 0..63 (uint8) -> [..., 24] bytes of the q6_k layout."""
    nibbles = (q[..., : BLOCK // 2] & 15) | ((q[..., BLOCK // 2 :] & 15) << 4)
    pairs = (q >> 4).reshape(*q.shape[:-1], 4, 8) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    return torch.cat((nibbles, pairs.sum(-2, dtype=torch.uint8)), dim=-1)  # distinct bits: the sum is an OR


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


class QuantizedParts(NamedTuple):
    """A fused projection's rows in parts of different layouts, stacked: a K-quant file's q|k|v
    (llama-quantize gives some layers' v more bits than their q and k), kept in each shard's own
    bits for a kernel that multiplies by several layouts in one call."""

    parts: tuple[QuantizedWeight, ...]

    @property
    def out_features(self) -> int:
        return sum(w.out_features for w in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features


class FileBlocks(NamedTuple):
    """A projection's rows as a GGUF file keeps them, not read yet: a kernel that regroups the
    file's blocks straight into its own layout (its `file_formats`) reads them `step` rows at a
    time; anything else takes `weight()`, the QuantizedWeight they repack into."""

    file_format: str  # a GGUF_BLOCKS key
    out_features: int
    in_features: int
    # the raw blocks of a range of rows while the context lasts, [rows, bytes of a row] uint8
    read: Callable[[slice], AbstractContextManager[np.ndarray]]
    order: torch.Tensor | None  # the stored row each row is (None: its own): llama.cpp's q / k permutation
    weight: Callable[[], QuantizedWeight]
    step: int


class FileShards(NamedTuple):
    """A projection's shards, each rows of a file not read yet, stacked in order."""

    shards: tuple[FileBlocks, ...]

    @property
    def out_features(self) -> int:
        return sum(shard.out_features for shard in self.shards)

    @property
    def in_features(self) -> int:
        return self.shards[0].in_features

    def runs(self) -> list[tuple[FileBlocks, ...]]:
        """Its shards in runs of one file format (as `cat` stacks runs of one layout): each run
        becomes one part of a kernel's."""
        return [tuple(run) for _, run in itertools.groupby(self.shards, lambda shard: shard.file_format)]


def cat(weights: list[QuantizedWeight], parts: bool = False) -> QuantizedWeight | QuantizedParts:
    """Stacks the rows of weights (a fused projection's shards). Where their layouts differ:
    with `parts` (a kernel that takes QuantizedParts), runs of shards of one layout are stacked
    and kept apart; else all become q8_0 with mins first (`as_bytes`), which holds each exactly
    but a q6_k shard, which first becomes q8_0 blocks of its values (`requantize`), the one
    inexact step."""
    if parts and len({w.format for w in weights}) > 1:
        return QuantizedParts(tuple(cat(list(run)) for _, run in itertools.groupby(weights, lambda w: w.format)))
    if len({w.format for w in weights}) > 1:
        weights = [as_bytes(requantize(dequantize(w)) if w.format == "q6_k" else w) for w in weights]
    if any(w.mins is not None for w in weights):
        weights = [w if w.mins is not None else w._replace(mins=torch.zeros_like(w.scales)) for w in weights]
    mins = None if weights[0].mins is None else torch.cat([w.mins for w in weights])
    k_scales = None  # kept where every shard has them; otherwise the fp32 ones serve
    if all(w.k_scales is not None for w in weights):
        k_scales = KScales(*(None if parts[0] is None else torch.cat(parts) for parts in zip(*(w.k_scales for w in weights))))
    return QuantizedWeight(
        weights[0].format, torch.cat([w.quants for w in weights]), torch.cat([w.scales for w in weights]), mins,
        k_scales,
    )


def as_bytes(weight: QuantizedWeight) -> QuantizedWeight:
    """The same weight in the q8_0 layout, exactly: a q4_1 or q5_1 quant u (0..31) is the byte u,
    under the same scale and min."""
    assert weight.format != "q6_k", "a q6_k weight's scales are per 16 inputs: requantize it"
    if weight.format == "q8_0":
        return weight
    return QuantizedWeight("q8_0", block_quants(weight).to(torch.int8).reshape(weight.out_features, -1),
                           weight.scales, weight.mins, weight.k_scales)


def block_quants(weight: QuantizedWeight) -> torch.Tensor:
    """[N, K / 32, 32]: each block's integer quants in input order (q4_1: 0..15 uint8, its nibbles
    unpacked; q5_1: 0..31 uint8; q6_k: 0..63 uint8; q8_0: int8)."""
    rows, blocks = weight.out_features, weight.in_features // BLOCK
    if weight.format == "q8_0":
        return weight.quants.reshape(rows, blocks, BLOCK)
    packed = weight.quants.reshape(rows, blocks, LAYOUT_BYTES[weight.format])
    q = torch.cat((packed[..., : BLOCK // 2] & 15, packed[..., : BLOCK // 2] >> 4), dim=-1)
    if weight.format == "q5_1":
        high = packed[..., BLOCK // 2 :, None] >> torch.arange(8, dtype=torch.uint8)  # [.., 4 bytes, 8 bits]
        q |= (high.reshape(rows, blocks, BLOCK) & 1) << 4
    elif weight.format == "q6_k":
        pairs = packed[..., None, BLOCK // 2 :] >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
        q |= (pairs.reshape(rows, blocks, BLOCK) & 3) << 4  # input 8 a + b: bits 2 a of byte b
    return q


def _signed_quants(weight: QuantizedWeight) -> torch.Tensor:
    """[N, K / scale, scale]: each scale's quants as they multiply it (q6_k's q - 32, per 16)."""
    if weight.format != "q6_k":
        return block_quants(weight)
    return (block_quants(weight).to(torch.int16) - Q6_OFFSET).reshape(weight.out_features, -1, SUB_BLOCK)


def dequantize(weight: QuantizedWeight | QuantizedParts) -> torch.Tensor:
    """[N, K] fp32, bit for bit what gguf-py (and so transformers) makes of the same blocks."""
    if isinstance(weight, QuantizedParts):
        return torch.cat([dequantize(w) for w in weight.parts])
    w = weight.scales[..., None] * _signed_quants(weight).float()
    if weight.mins is not None:
        w += weight.mins[..., None]  # in place: a large table's dequantization holds one fp32 copy less
    return w.reshape(weight.out_features, weight.in_features)


def linear(x: torch.Tensor, weight: QuantizedWeight | QuantizedParts, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The twin of quant_cpu.QuantizedLinear: x W^T (+ b) on the dequantized weight."""
    return F.linear(x, dequantize(weight), bias)


class QuantizedRows(NamedTuple):
    """Activations in 8-bit blocks of 32 (llama.cpp's Q8_1): x ~ e * v, one e per block or, for a
    weight with K-quant scales, per super-block of 256 (llama.cpp's Q8_K), and s = e * sum(v) per
    block."""

    v: torch.Tensor  # [M, K] int8, -127..127
    e: torch.Tensor  # [M, K / 32] fp32; by super-blocks [M, K / 256]
    s: torch.Tensor  # [M, K / 32] fp32


def quantize_rows(x: torch.Tensor, super_blocks: bool = False) -> QuantizedRows:
    """x [M, K] fp32 -> its blocks, as trillm/kernels/quant_int8_cpu.h makes them, bit for bit:
    over each block (or super-block) e = max|x| / 127, v = round-half-even(x * (1 / e)), 0 where
    e is 0."""
    rows, k = x.shape
    span = BLOCK * SUPER_BLOCKS if super_blocks else BLOCK
    spans = x.reshape(rows, k // span, span)
    e = spans.abs().amax(dim=-1) / 127.0
    inv = torch.where(e != 0, 1.0 / e, torch.zeros_like(e))
    v = torch.round(spans * inv[..., None]).to(torch.int8).reshape(rows, k // BLOCK, BLOCK)
    per_block = e.repeat_interleave(span // BLOCK, dim=1)
    s = per_block * v.sum(dim=-1, dtype=torch.int32).float()
    return QuantizedRows(v.reshape(rows, k), e, s)


def linear_int8(x: torch.Tensor, weight: QuantizedWeight | QuantizedParts,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """The twin of quant_cpu.Int8QuantizedLinear: x's rows quantized by `quantize_rows` (by
    super-blocks where the weight keeps K-quant scales), then per block of 32 inputs d e sum(q v)
    + m s (q8_0 without mins: the exact d e sum(q v)), in float64 so that only the kernel's fp32
    sums differ from it."""
    if isinstance(weight, QuantizedParts):
        y = torch.cat([linear_int8(x, w) for w in weight.parts], dim=-1)
        return y if bias is None else y + bias
    shape = x.shape
    rows = quantize_rows(x.reshape(-1, shape[-1]).float(), super_blocks=weight.k_scales is not None)
    q = _signed_quants(weight)
    n, per_scale = q.shape[0], q.shape[1] // rows.e.shape[1]  # scales under one e: 1 or 2 by blocks, 8 or 16 by supers
    v = rows.v.reshape(-1, q.shape[1], q.shape[2])
    dots = torch.einsum("mbk,nbk->mnb", v.double(), q.double())  # exact: integers below 2^53
    e = rows.e.double().repeat_interleave(per_scale, dim=1)
    y = (dots * weight.scales.double()[None] * e[:, None]).sum(-1)
    if weight.mins is not None:
        y += rows.s.double() @ weight.mins.double().T
    y = y.float()
    if bias is not None:
        y += bias
    return y.reshape(*shape[:-1], n)
