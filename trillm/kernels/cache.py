"""Writing new keys and values into the paged KV cache, torch reference twin.

Layout (per layer): k_cache and v_cache are [num_blocks, block_size, num_kv_heads, head_dim];
token t goes to slot = block_id * block_size + offset. A negative slot marks padding.
"""
import torch


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, Hk, D]; slot_mapping: [T] int64 (negative = skip)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
