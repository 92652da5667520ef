"""Paged attention over a batch that mixes prefill chunks and decode tokens, torch reference twin.

Request b owns the query rows q[query_start_loc[b]:query_start_loc[b+1]] (nq of them); its
context is seq_lens[b] tokens long, already written to the cache (new tokens included), so its
queries sit at positions seq_lens[b] - nq ... seq_lens[b] - 1. Each query attends causally to
the keys at positions <= its own (and > its own - sliding_window when a window is set),
fetched through block_tables[b].
"""
import torch
import torch.nn.functional as F


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Keys (or values) of positions [0, length) for each row of block_tables: [B, length, Hk, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size
    return cache.view(-1, *cache.shape[2:])[slots]


def _attend(q, k, v, q_pos, k_len, scale, sliding_window):
    """q: [B, Q, H, D]; k, v: [B, L, Hk, D]; q_pos: [B, Q]; k_len: [B]. Returns [B, Q, H, D]."""
    k_pos = torch.arange(k.shape[1], device=q.device)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < k_len[:, None, None])
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2).float(),
        k.transpose(1, 2).float(),
        v.transpose(1, 2).float(),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2).to(q.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; caches: [num_blocks, block_size, Hk, D]; block_tables: [B, max_blocks] int32;
    seq_lens: [B] int32; query_start_loc: [B + 1] int32. Returns [T, H, D].

    Decode rows (one query each) run as one padded batch; each prefill chunk runs on its own,
    so a long prompt never pads every decode row to its length.
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    num_queries = [starts[b + 1] - starts[b] for b in range(len(lens))]
    decode = [b for b, nq in enumerate(num_queries) if nq == 1]
    if decode:
        idx = torch.tensor(decode, device=q.device)
        rows = torch.tensor([starts[b] for b in decode], device=q.device)
        k_len = seq_lens[idx].long()
        k = _gather_kv(k_cache, block_tables[idx], max(lens[b] for b in decode))
        v = _gather_kv(v_cache, block_tables[idx], max(lens[b] for b in decode))
        out[rows] = _attend(q[rows, None], k, v, (k_len - 1)[:, None], k_len, scale, sliding_window)[:, 0]
    for b, nq in enumerate(num_queries):
        if nq <= 1:
            continue
        k = _gather_kv(k_cache, block_tables[b : b + 1], lens[b])
        v = _gather_kv(v_cache, block_tables[b : b + 1], lens[b])
        q_pos = torch.arange(lens[b] - nq, lens[b], device=q.device)[None]
        k_len = seq_lens[b : b + 1].long()
        out[starts[b] : starts[b + 1]] = _attend(
            q[None, starts[b] : starts[b + 1]], k, v, q_pos, k_len, scale, sliding_window
        )[0]
    return out
