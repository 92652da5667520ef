"""GGUF's quantized weights, kept quantized: their layout for the kernels, and the torch twin.

Why keep them: a decode step on CPU costs about the time it takes to stream every weight once, and
these formats are 4.5 to 8.5 bits a weight against fp32's 32 (trillm/kernels/quant_cpu.h
multiplies by them directly). The twin dequantizes exactly as gguf-py does, so a dequantized
weight equals the one transformers loads from the file.

Two layouts, named after the GGUF formats they come from, hold every format read here: "q4_1",
blocks of 32 unsigned 4-bit quants with an fp32 scale d and min m each (w = d q + m); "q8_0",
blocks of 32 signed 8-bit quants with a scale each (w = d q). A file's formats are repacked into
them at load, exactly (the products of fp16 scales and 6-bit sub-block scales fit fp32's
mantissa, so w comes out bit for bit as gguf-py computes it):
- Q4_1 and Q8_0 as they are;
- Q4_0 (w = d (q - 8)) as q4_1 with m = -8 d;
- Q5_0 (w = d (q - 16), q of 5 bits) as q8_0 with q - 16;
- Q4_K (super-blocks of 256: eight sub-blocks of 32, each w = d sc q - dmin mn, sc and mn 6-bit)
  as q4_1, each sub-block a block with d = d sc and m = -dmin mn.
Q5_1, Q5_K, Q6_K (16-value sub-blocks with their own scales) and the other formats fit neither
layout exactly: `requantize` makes q8_0 blocks of their dequantized values, 8 bits a weight where
the file's were 2 to 6, each within half a step of 1/127 of its block's largest magnitude (a step
several times finer than the file's own). trillm/model/gguf_weights.py logs which were.

Layout in memory: quants, q4_1 [N, K / 2] uint8 (a block's 16 bytes hold input j in the low
nibble and j + 16 in the high one) or q8_0 [N, K] int8; scales and mins [N, K / 32] fp32 (the
kernel converts nothing).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

BLOCK = 32
# format read from a file -> (values, bytes) of one of its GGUF blocks
GGUF_BLOCKS = {"q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q8_0": (32, 34), "q4_k": (256, 144)}


class QuantizedWeight(NamedTuple):
    format: str  # the layout: "q4_1" | "q8_0"
    quants: torch.Tensor  # q4_1: [N, K / 2] uint8; q8_0: [N, K] int8
    scales: torch.Tensor  # [N, K / 32] fp32
    mins: torch.Tensor | None  # q4_1: [N, K / 32] fp32

    @property
    def out_features(self) -> int:
        return self.scales.shape[0]

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * BLOCK

    def columns(self, start: int, end: int) -> QuantizedWeight:
        """Input columns [start, end), which must fall on block boundaries (a row-parallel shard)."""
        assert start % BLOCK == 0 and end % BLOCK == 0, f"columns {start}:{end} split a {BLOCK}-wide block"
        per_block = self.quants.shape[1] // self.scales.shape[1]  # bytes (q4_1) or values (q8_0) per block
        blocks = slice(start // BLOCK, end // BLOCK)
        return QuantizedWeight(
            self.format, self.quants[:, blocks.start * per_block : blocks.stop * per_block].contiguous(),
            self.scales[:, blocks].contiguous(), None if self.mins is None else self.mins[:, blocks].contiguous(),
        )

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The weight of some output rows (a reordering, a shard): blocks never span two rows."""
        return QuantizedWeight(
            self.format, self.quants[index], self.scales[index], None if self.mins is None else self.mins[index]
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
        high = blocks[..., 2:6].contiguous().view(torch.int32)  # bit j: the fifth bit of value j
        fifth = ((high >> torch.arange(BLOCK, dtype=torch.int32)) & 1).to(torch.uint8) << 4
        low = blocks[..., 6:]
        q = (torch.cat((low & 15, low >> 4), dim=-1) | fifth).to(torch.int8) - 16
        return QuantizedWeight("q8_0", q.reshape(rows, -1).contiguous(), fp16_at(0), None)
    return _from_q4_k(blocks, fp16_at(0), fp16_at(2))


def requantize(weight: torch.Tensor) -> QuantizedWeight:
    """An fp32 [N, K] weight (K a multiple of 32) as q8_0 blocks, quantized as activations are
    (quantize_rows): d = max|w| / 127 per block, q = round(w / d), so |d q - w| <= d / 2."""
    rows = quantize_rows(weight.float())
    return QuantizedWeight("q8_0", rows.v, rows.e, None)


def _from_q4_k(blocks: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> QuantizedWeight:
    """Q4_K super-blocks [N, K / 256, 144] as q4_1 blocks of 32. A super-block: fp16 d and dmin, 12
    bytes of eight 6-bit scales and eight 6-bit mins, then 128 bytes of quants, 32 a pair of
    sub-blocks: the low nibbles the first of the pair, the high ones the second."""
    rows, supers = blocks.shape[:2]
    packed = blocks[..., 4:16].reshape(rows, supers, 3, 4)
    low6, mins_low6, high = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    scales = torch.cat((low6 & 0x3F, (high & 0x0F) | ((low6 >> 2) & 0x30)), dim=-1)
    mins = torch.cat((mins_low6 & 0x3F, (high >> 4) | ((mins_low6 >> 2) & 0x30)), dim=-1)
    pairs = blocks[..., 16:].reshape(rows, supers, 4, 1, BLOCK)
    q = torch.cat((pairs & 15, pairs >> 4), dim=3).reshape(rows, supers * 8, BLOCK)  # sub-blocks in order
    nibbles = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
    return QuantizedWeight(
        "q4_1", nibbles.reshape(rows, -1).contiguous(), (d[..., None] * scales.float()).reshape(rows, -1),
        (-(dmin[..., None] * mins.float())).reshape(rows, -1),
    )


def cat(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stacks the rows of weights of one format (a fused projection's shards)."""
    formats = {w.format for w in weights}
    assert len(formats) == 1, formats
    mins = None if weights[0].mins is None else torch.cat([w.mins for w in weights])
    return QuantizedWeight(
        weights[0].format, torch.cat([w.quants for w in weights]), torch.cat([w.scales for w in weights]), mins
    )


def block_quants(weight: QuantizedWeight) -> torch.Tensor:
    """[N, K / 32, 32]: each block's integer quants in input order (Q4_1: 0..15 uint8, its nibbles
    unpacked; Q8_0: int8)."""
    rows, blocks = weight.scales.shape
    if weight.format == "q4_1":
        packed = weight.quants.reshape(rows, blocks, BLOCK // 2)
        return torch.cat((packed & 15, packed >> 4), dim=-1)
    return weight.quants.reshape(rows, blocks, BLOCK)


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
    block of 32 inputs d e sum(q v) + m s (Q8_0: the exact d e sum(q v)), in float64 so that
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
