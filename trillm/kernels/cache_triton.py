"""Writing new keys and values into the paged KV cache as a Triton kernel; twin of `cache.py`.

Layout (per layer): k_cache and v_cache are [num_blocks, block_size, num_kv_heads, row_width]
(`cache.py`: the values, or an int8 cache's quantized rows and their scales);
token t goes to slot = block_id * block_size + offset. A negative slot marks padding (e.g.
CUDA-graph padding rows): its program stores nothing, so no host-side filtering (and no
device-to-host sync) is needed.
"""
import torch
import triton
import triton.language as tl

from trillm.kernels.cache import keys_for, row_width


@triton.jit
def _store_int8_rows(cache_ptr, rows, dims, x, mask, HEAD_DIM: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] as int8 cache rows starting at cache_ptr + rows ([BLOCK_H, 1]), as
    cache.quantize_rows makes them: the values over fp16(absmax / 127), rounded to nearest even
    (adding and taking away 1.5 * 2**23 rounds a float below 2**22 so), then the scale."""
    x = x.to(tl.float32)
    scale = (tl.max(tl.where(mask, tl.abs(x), 0.0), 1) / 127.0).to(tl.float16)
    s = scale.to(tl.float32)[:, None]
    r = tl.math.div_rn(x, tl.where(s > 0, s, 1.0))
    r = (r + 12582912.0) - 12582912.0
    r = tl.where(s > 0, tl.minimum(tl.maximum(r, -127.0), 127.0), 0.0)
    tl.store(cache_ptr + rows + dims, r.to(tl.int8), mask=mask)
    scale_ptr = (cache_ptr + rows + HEAD_DIM).to(tl.pointer_type(tl.float16), bitcast=True)
    tl.store(scale_ptr, scale[:, None], mask=tl.max(mask.to(tl.int32), 1)[:, None] > 0)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_tok_stride, k_head_stride, v_tok_stride, v_head_stride,
    num_kv_heads,
    HEAD_DIM: tl.constexpr, ROW: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return  # a padding row
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + tok * k_tok_stride + heads * k_head_stride + dims, mask=mask)
    v = tl.load(v_ptr + tok * v_tok_stride + heads * v_head_stride + dims, mask=mask)
    # The cache is contiguous, so a slot is num_kv_heads rows of ROW elements.
    rows = slot * (num_kv_heads * ROW) + heads * ROW
    if QUANTIZED:
        _store_int8_rows(k_cache_ptr, rows, dims, k, mask, HEAD_DIM)
        _store_int8_rows(v_cache_ptr, rows, dims, v, mask, HEAD_DIM)
    else:
        tl.store(k_cache_ptr + rows + dims, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + rows + dims, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, Hk, D]; slot_mapping: [T] int64 (negative = skip)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert k_cache.shape[2:] == (num_kv_heads, row_width(head_dim, k_cache.dtype)) and v_cache.shape == k_cache.shape
    assert v_cache.dtype == k_cache.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    if num_tokens == 0:
        return
    k = keys_for(k, k_cache.dtype)  # an int8 cache's keys are rotated first (cache.py)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_kv_heads,
        HEAD_DIM=head_dim, ROW=k_cache.shape[3], BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), QUANTIZED=k_cache.dtype == torch.int8,
    )
