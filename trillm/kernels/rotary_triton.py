"""Rotary position embedding, in place on q and k, as a Triton kernel; twin of `rotary.py`.

One program per token: it reads the token's cos/sin row once and rotates every query and
key head with it, so the table is not re-read per head.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, tok, tok_stride, head_stride, num_heads, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  IS_NEOX: tl.constexpr):
    """Rotates the [num_heads, 2 * HALF] heads of one token in place, in fp32."""
    heads = tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_HALF)
    if IS_NEOX:  # halves: (x[i], x[i + D/2])
        first, second = pairs, pairs + HALF
    else:  # interleaved: (x[2i], x[2i + 1])
        first, second = 2 * pairs, 2 * pairs + 1
    base = x_ptr + tok * tok_stride + heads[:, None] * head_stride
    mask = (heads[:, None] < num_heads) & (pairs[None, :] < HALF)
    x1 = tl.load(base + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + second[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    tl.store(base + first[None, :], (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(base + second[None, :], (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr,
    q_tok_stride, q_head_stride, k_tok_stride, k_head_stride, cache_stride,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    pairs = tl.arange(0, BLOCK_HALF)
    row = cache_ptr + pos * cache_stride
    cos = tl.load(row + pairs, mask=pairs < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + HALF + pairs, mask=pairs < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, tok, q_tok_stride, q_head_stride, num_q_heads, cos, sin,
                  HALF, BLOCK_HQ, BLOCK_HALF, IS_NEOX)
    _rotate_heads(k_ptr, tok, k_tok_stride, k_head_stride, num_k_heads, cos, sin,
                  HALF, BLOCK_HK, BLOCK_HALF, IS_NEOX)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """positions: [T] int; q: [T, Hq, D]; k: [T, Hk, D]; cos_sin_cache: [max_pos, D] fp32,
    holding cos in its first D/2 columns and sin in the last D/2.

    neox layout rotates the two halves of each head (x[:D/2], x[D/2:]); gpt-j layout
    rotates interleaved pairs (x[0::2], x[1::2]). q and k are overwritten. They may be
    strided views (e.g. slices of a fused qkv projection) as long as head_dim is contiguous.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim and head_dim % 2 == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "head_dim must be contiguous"
    assert cos_sin_cache.shape[-1] == head_dim and cos_sin_cache.stride(-1) == 1
    assert positions.shape == (num_tokens,)
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        num_q_heads, k.shape[1],
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        IS_NEOX=is_neox,
    )
