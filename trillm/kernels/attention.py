"""Paged attention over a batch that mixes prefill chunks and decode tokens, torch reference twin.

Request b owns the query rows q[query_start_loc[b]:query_start_loc[b+1]] (nq of them); its
context is seq_lens[b] tokens long, already written to the cache (new tokens included), so its
queries sit at positions seq_lens[b] - nq ... seq_lens[b] - 1. Each query attends causally to
the keys at positions <= its own (and > its own - sliding_window when a window is set),
fetched through block_tables[b].

The work splits in two: `plan_attention` turns the step's metadata into cache slots and masks,
`attend_planned` gathers keys and values through them and runs SDPA. The plan depends on the
metadata only, so a model builds it once per step and reuses it in every layer (the torch
backend keeps it in AttentionMetadata.per_step): on CPU, rebuilding slots and masks in each of
30 layers cost more than the attention math itself.

Given a `row_kernel` (the compiled CPU kernel in attention_cpu.pyx, with this module's
`paged_attention` signature), the whole step, decode and prefill rows alike, goes through it: the
kernel reads each row's keys and values straight from the cache blocks, and a row's arithmetic
does not depend on what else the step holds. So a
prompt gives the same output whether it is prefilled whole, in chunks, after a prefix-cache hit
or beside other requests (with SDPA, whose blocking follows the number of queries, a greedy
answer could change with the cache's state once 8-bit activations amplified the last bits).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trillm.kernels.cache import from_cache, keys_for


@dataclass
class Group:
    """Requests attended together: their query rows, the cache slots of their keys, and the mask."""

    rows: slice | torch.Tensor  # query rows of q, in order
    num_queries: int  # per request (1 for the decode group)
    slots: torch.Tensor  # [B * L] int64: the cache slots of positions 0 .. L-1 of each request
    # [B, 1, num_queries, L] bool: True where a query may see a key. None: one request whose
    # context is its queries alone (a whole prompt in one chunk, no window cutting into it), so
    # plain causal attention, which SDPA takes as `is_causal`, with no mask to build or convert.
    mask: torch.Tensor | None

    def attend(self, q, k_cache, v_cache, scale: float) -> torch.Tensor:
        """The group's rows of the output, [B * num_queries, H, D]."""
        num_queries = self.num_queries
        batch, length = (1, num_queries) if self.mask is None else (self.mask.shape[0], self.mask.shape[3])
        num_kv_heads, width = k_cache.shape[2:]
        head_dim = q.shape[-1]
        k = from_cache(k_cache.view(-1, num_kv_heads, width).index_select(0, self.slots))
        v = from_cache(v_cache.view(-1, num_kv_heads, width).index_select(0, self.slots))
        k, v = k.view(batch, length, -1, head_dim), v.view(batch, length, -1, head_dim)
        qg = keys_for(q[self.rows], k_cache.dtype).view(batch, num_queries, -1, head_dim)
        out = F.scaled_dot_product_attention(
            qg.transpose(1, 2).float(),
            k.transpose(1, 2).float(),
            v.transpose(1, 2).float(),
            attn_mask=self.mask,
            is_causal=self.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(1, 2).reshape(batch * num_queries, -1, head_dim).to(q.dtype)


@dataclass
class PagedGroup:
    """The whole step for a kernel that reads the paged cache itself (the twin's own signature,
    `paged_attention`): every request's rows, block table and context length as the step has them."""

    block_tables: torch.Tensor  # [B, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor | None  # [B + 1] int32; None when each request has one row
    sliding_window: int | None
    kernel: Callable

    def attend(self, q, k_cache, v_cache, scale: float) -> torch.Tensor:
        return self.kernel(q.contiguous(), k_cache, v_cache, self.block_tables, self.seq_lens, self.query_start_loc,
                           scale, self.sliding_window)


@dataclass
class AttentionPlan:
    num_tokens: int
    groups: list[Group | PagedGroup]  # the decode rows as one group, then each prefill chunk
    single_group: bool  # one group holding every row in order: its output is the whole output


def _slots(block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions [0, length) for each row of block_tables: [B * length]."""
    pos = torch.arange(length, device=block_tables.device)
    return (block_tables[:, pos // block_size].long() * block_size + pos % block_size).flatten()


def _mask(q_pos: torch.Tensor, k_len: torch.Tensor, length: int, sliding_window: int | None) -> torch.Tensor:
    """q_pos: [B, Q]; k_len: [B]. Returns [B, 1, Q, length] bool."""
    k_pos = torch.arange(length, device=q_pos.device)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < k_len[:, None, None])
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    return mask[:, None]


def plan_attention(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
    row_kernel: Callable | None = None,
) -> AttentionPlan:
    """With a row_kernel: every row in one group. Without: decode rows (one query each) form one
    padded group, and each prefill chunk is its own group, so a long prompt never pads every
    decode row to its length."""
    if row_kernel is not None:
        return _plan_rows(block_tables, seq_lens, query_start_loc, sliding_window, row_kernel)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    num_queries = [starts[b + 1] - starts[b] for b in range(len(lens))]
    groups = []
    decode = [b for b, nq in enumerate(num_queries) if nq == 1]
    if decode:
        length = max(lens[b] for b in decode)
        if len(decode) == len(lens):  # a pure-decode step: row b is request b, nothing to index
            rows, tables, k_len = slice(0, len(lens)), block_tables, seq_lens
        else:
            idx = torch.tensor(decode, device=block_tables.device)
            rows = torch.tensor([starts[b] for b in decode], device=block_tables.device)
            tables, k_len = block_tables[idx], seq_lens[idx]
        k_len = k_len.long()
        groups.append(Group(rows, 1, _slots(tables, length, block_size),
                            _mask((k_len - 1)[:, None], k_len, length, sliding_window)))
    for b, nq in enumerate(num_queries):
        if nq <= 1:
            continue
        if lens[b] == nq and (sliding_window is None or sliding_window >= nq):
            mask = None
        else:
            q_pos = torch.arange(lens[b] - nq, lens[b], device=block_tables.device)[None]
            mask = _mask(q_pos, seq_lens[b : b + 1].long(), lens[b], sliding_window)
        groups.append(Group(slice(starts[b], starts[b + 1]), nq, _slots(block_tables[b : b + 1], lens[b], block_size), mask))
    return AttentionPlan(starts[-1], groups, single_group=bool(decode) and len(decode) == len(lens))


def _plan_rows(block_tables, seq_lens, query_start_loc, sliding_window, row_kernel) -> AttentionPlan:
    """The whole step as one group for row_kernel, which takes it as the step has it."""
    num_rows = int(query_start_loc[-1])
    starts = None if num_rows == seq_lens.shape[0] else query_start_loc.int().contiguous()
    group = PagedGroup(block_tables.contiguous(), seq_lens.contiguous(), starts, sliding_window, row_kernel)
    return AttentionPlan(num_rows, [group], single_group=True)


def attend_planned(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan, scale: float
) -> torch.Tensor:
    """q: [T, H, D]; caches: [num_blocks, block_size, Hk, row_width] (trillm/kernels/cache.py).
    Returns [T, H, D]."""
    assert q.shape[0] == plan.num_tokens, (q.shape, plan.num_tokens)
    if plan.single_group:
        return plan.groups[0].attend(q, k_cache, v_cache, scale)  # no scatter into a new tensor
    out = torch.empty_like(q)
    for group in plan.groups:
        out[group.rows] = group.attend(q, k_cache, v_cache, scale)
    return out


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
    """q: [T, H, D]; caches: [num_blocks, block_size, Hk, row_width] (D, or D + 2 for an int8
    cache: trillm/kernels/cache.py); block_tables: [B, max_blocks] int32; seq_lens: [B] int32;
    query_start_loc: [B + 1] int32. Returns [T, H, D]."""
    plan = plan_attention(block_tables, seq_lens, query_start_loc, k_cache.shape[1], sliding_window)
    return attend_planned(q, k_cache, v_cache, plan, scale)
