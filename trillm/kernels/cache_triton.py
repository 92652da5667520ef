"""Writing new keys and values into the paged KV cache as a Triton kernel; twin of `cache.py`.

Layout (per layer): k_cache and v_cache are [num_blocks, block_size, num_kv_heads, head_dim];
token t goes to slot = block_id * block_size + offset. A negative slot marks padding (e.g.
CUDA-graph padding rows): its program stores nothing, so no host-side filtering (and no
device-to-host sync) is needed.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_tok_stride, k_head_stride, v_tok_stride, v_head_stride,
    num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return  # a padding row
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
    # The cache is contiguous, so a slot is a row of num_kv_heads * HEAD_DIM elements.
    dst = slot * (num_kv_heads * HEAD_DIM) + heads * HEAD_DIM + dims
    k = tl.load(k_ptr + tok * k_tok_stride + heads * k_head_stride + dims, mask=mask)
    v = tl.load(v_ptr + tok * v_tok_stride + heads * v_head_stride + dims, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


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
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
