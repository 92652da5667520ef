"""Writing new keys and values into the paged KV cache, torch reference twin.

Layout (per layer): k_cache and v_cache are [num_blocks, block_size, num_kv_heads, row_width];
token t goes to slot = block_id * block_size + offset. A negative slot marks padding.

A cache in fp32, fp16 or bf16 holds the values themselves (row_width = head_dim). An int8 cache
holds each (token, head) row of head_dim values quantized on its own: head_dim int8 values
`round(x / scale)` and then the row's scale, `absmax / 127` as an fp16, in the row's last two
bytes (row_width = head_dim + 2), so a row costs 66 bytes where fp16 took 128. The scale belongs
to one row, not to a cache block: a block fills over many steps, and a row written once and never
requantized decodes to the same values however its prompt was chunked (the attention kernels'
per-row determinism depends on it).

An int8 cache's keys are rotated before they are quantized (`rotate_rows`, a normalized
Walsh-Hadamard transform of each head's row), and every attention kernel over an int8 cache
rotates its queries the same way: the rotation is orthogonal, so q.k is unchanged, but a few of a
key's channels carry most of its magnitude, and one scale per row sized to them left the other
channels a handful of int8 steps; rotated, every channel carries a share of the outliers
(benchmarks/README.md has what it did to agreement with the fp16 cache). Values are not rotated:
their rows have no such outliers, and rotating them would need the output rotated back.
"""
import math

import torch

INT8_SCALE_BYTES = 2  # the fp16 scale after each row's int8 values


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The last dimension of a cache in `dtype` for rows of head_dim values."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def cache_shape(layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> tuple[int, ...]:
    """A paged KV cache's [layers, K and V, num_blocks, block_size, kv_heads, row_width]."""
    return (layers, 2, num_blocks, block_size, kv_heads, row_width(head_dim, dtype))


def kv_block_bytes(layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block of K and V over all layers."""
    return math.prod(cache_shape(layers, 1, block_size, kv_heads, head_dim, dtype)) * dtype.itemsize


def rotate_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> fp32 [..., D] times the normalized Walsh-Hadamard matrix when D is a power of
    two (x as fp32 otherwise), computed as the kernels do (shared_cpu.h's kv_rotate), so to the
    same bits: butterflies of stride 1, 2, 4, ..., then one product with fp32(1 / sqrt(D))."""
    x = x.float()
    dim = x.shape[-1]
    if dim < 2 or dim & (dim - 1):
        return x
    lead = x.shape[:-1]
    h = 1
    while h < dim:
        pairs = x.reshape(*lead, dim // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, dim)
        h *= 2
    return x * torch.tensor(1.0 / math.sqrt(dim), dtype=torch.float32, device=x.device)


def keys_for(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys (or the queries that meet them) as a cache in `dtype` compares them: rotated for an
    int8 cache, as they are for the others."""
    return rotate_rows(x) if dtype == torch.int8 else x


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> int8 [..., D + 2]: each row's values over its fp16 scale,
    rounded to nearest even, and the scale's bytes. A row of zeros has scale 0 and values 0."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / 127).to(torch.float16)
    s = scale.float()
    values = torch.where(s > 0, x / torch.where(s > 0, s, 1.0), 0.0).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([values, scale.view(torch.int8)], -1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 [..., D + 2] -> fp32 [..., D]: each value times its row's scale."""
    head_dim = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float16).float()
    return rows[..., :head_dim].float() * scale


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values [..., D] as a cache in `dtype` stores them."""
    return quantize_rows(x) if dtype == torch.int8 else x.to(dtype)


def from_cache(rows: torch.Tensor) -> torch.Tensor:
    """What cache rows [..., row_width] hold, as values [..., D] (fp32 from an int8 cache)."""
    return dequantize_rows(rows) if rows.dtype == torch.int8 else rows


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, Hk, D]; slot_mapping: [T] int64 (negative = skip). Each row is stored as the
    cache's dtype stores it (to_cache; keys_for first for the keys)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, to_cache(keys_for(k, k_cache.dtype),
                                                                                k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, to_cache(v, v_cache.dtype))
