"""Unified paged attention as Triton kernels; twin of `attention.py`.

Request b owns the query rows q[query_start_loc[b]:query_start_loc[b+1]] (nq of them); its
context is seq_lens[b] tokens long, already written to the cache (new tokens included), so its
queries sit at positions seq_lens[b] - nq ... seq_lens[b] - 1. Each query attends causally to
the keys at positions <= its own (and > its own - sliding_window when a window is set),
fetched through block_tables[b].

One launch serves the whole step, whatever its mix of decode tokens, prefill chunks and
prefix-cache hits: all three are "nq queries at the end of a seq_len context".

Grid: (q blocks, kv heads, splits).
- A program owns BLOCK_M rows = BLOCK_Q consecutive query tokens x the GROUP query heads that
  share one kv head (GQA), so each K/V tile is loaded once for all of them and feeds a real
  matrix multiply even when BLOCK_Q is 1 (decode).
- Request b's q blocks are numbered from query_start_loc[b] // BLOCK_Q + b. That numbering
  leaves gaps (programs that exit at once) but bounds the total by T // BLOCK_Q + B, which
  depends on shapes only: no device-to-host sync, so the launch can be captured in a CUDA
  graph. A program finds its request by binary search over query_start_loc.
- KV is walked in TILE_N-token tiles with an online softmax; a tile may span several cache
  blocks (each token's block is looked up in the block table), so TILE_N does not depend on
  the cache's block size.
- Split-KV (flash decoding): with few requests and long contexts, B * Hk programs cannot fill
  the GPU, so each program's KV range is cut into NUM_SPLITS parts handled by separate
  programs, which write unnormalized partial results (acc, running max, running sum); a
  second kernel merges them. Same kernel, NUM_SPLITS > 1.

TILE_N, the q-tile heights, the warp counts and the split heuristic's constants come from
reasoning and from register counts of sm_90 builds; they have not been tuned on a GPU yet
(benchmarks/bench_kernels.py is the tool for that).
"""
import functools

import torch
import triton
import triton.language as tl

from trillm.kernels.cache import keys_for, row_width

TILE_N = 32  # keys per inner-loop step
MIN_TOKENS_PER_SPLIT = 256  # fewer keys per split would hardly repay the merge kernel
MAX_SPLITS = 16
_LOG2E = 1.4426950408889634
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _find_request(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The last request b whose first q block (query_start_loc[b] // BLOCK_Q + b) is <= q_block."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2, window, num_seqs, num_heads,
    q_tok_stride, q_head_stride, out_tok_stride, out_head_stride,
    cache_block_stride, cache_tok_stride, cache_head_stride, block_table_stride,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr, QUANTIZED: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_request(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    num_q = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= num_q:
        return  # a gap in the q-block numbering
    context = tl.load(seq_lens_ptr + seq) - num_q  # position of the request's first query

    rows = tl.arange(0, BLOCK_M)
    q_idx = local_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < num_q)
    q_pos = context + q_idx
    tok = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + tok[:, None] * q_tok_stride + head[:, None] * q_head_stride + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    ).to(DOT_DTYPE)

    # Keys this tile of queries can see: [kv_begin, kv_end).
    kv_end = context + tl.minimum((local_block + 1) * BLOCK_Q, num_q)
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(context + local_block * BLOCK_Q - window + 1, 0)
    tile_begin = kv_begin // TILE_N
    tile_end = tl.cdiv(kv_end, TILE_N)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tile_end - tile_begin, NUM_SPLITS)
        tile_begin = tile_begin + split * per_split
        tile_end = tl.minimum(tile_end, tile_begin + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    cols = tl.arange(0, TILE_N)
    block_table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    for tile in range(tile_begin, tile_end):
        kv_pos = tile * TILE_N + cols
        kv_ok = kv_pos < kv_end
        block = tl.load(block_table + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        kv_off = block * cache_block_stride + (kv_pos % BLOCK_SIZE) * cache_tok_stride \
            + kv_head * cache_head_stride
        k = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None],
                    mask=kv_ok[None, :] & dim_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :],
                    mask=kv_ok[:, None] & dim_ok[None, :], other=0.0)
        if QUANTIZED:  # int8 rows, each followed by its fp16 scale (cache.py)
            k_scale = tl.load((k_cache_ptr + kv_off + HEAD_DIM).to(tl.pointer_type(tl.float16), bitcast=True),
                              mask=kv_ok, other=0.0).to(tl.float32)
            v_scale = tl.load((v_cache_ptr + kv_off + HEAD_DIM).to(tl.pointer_type(tl.float16), bitcast=True),
                              mask=kv_ok, other=0.0).to(tl.float32)
            k = k.to(tl.float32) * k_scale[None, :]
            v = v.to(tl.float32) * v_scale[:, None]
        k = k.to(DOT_DTYPE)
        v = v.to(DOT_DTYPE)
        s = tl.dot(q, k, input_precision="ieee") * scale_log2
        visible = row_ok[:, None] & kv_ok[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen nothing yet keeps m = -inf; subtract 0 instead to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + tok[:, None] * out_tok_stride + head[:, None] * out_head_stride + dims[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        part = (tok * num_heads + head) * NUM_SPLITS + split  # index into [T, H, NUM_SPLITS]
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, out_tok_stride, out_head_stride, num_heads,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Combines one token's per-split partial softmaxes, all heads at once."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    mask = head_ok[:, None] & (dims[None, :] < HEAD_DIM)
    row = (tok * num_heads + heads) * NUM_SPLITS
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for split in range(NUM_SPLITS):
        m_s = tl.load(part_m_ptr + row + split, mask=head_ok, other=float("-inf"))
        l_s = tl.load(part_l_ptr + row + split, mask=head_ok, other=0.0)
        acc_s = tl.load(part_acc_ptr + (row + split)[:, None] * HEAD_DIM + dims[None, :],
                        mask=mask, other=0.0)
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        old_w = tl.exp2(m - m_safe)
        new_w = tl.exp2(m_s - m_safe)
        l = l * old_w + l_s * new_w
        acc = acc * old_w[:, None] + acc_s * new_w[:, None]
        m = m_new
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(out_ptr + tok * out_tok_stride + heads[:, None] * out_head_stride + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_sms: int, num_programs: int, max_context: int) -> int:
    """Split KV only when the plain grid leaves SMs idle and there is enough KV to share:
    aim at two programs per SM, with at least MIN_TOKENS_PER_SPLIT keys per split.

    Takes shapes only (max_context is the block table's capacity, an upper bound), so the
    choice needs no device-to-host sync.
    """
    if num_programs >= num_sms:
        return 1
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * num_sms, num_programs),
                      max_context // MIN_TOKENS_PER_SPLIT))


def _dot_dtype(q: torch.Tensor):
    """The interpreter (the only way Triton runs on CPU tensors) multiplies bf16 matrices
    as raw bits, so there bf16 operands are widened to fp32; on a GPU they stay bf16."""
    if q.dtype == torch.bfloat16 and not q.is_cuda:
        return tl.float32
    return _TL_DTYPES[q.dtype]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; caches: [num_blocks, block_size, Hk, row_width] (D, or D + 2 for an int8
    cache: cache.py); block_tables: [B, max_blocks] int32; seq_lens: [B] int32; query_start_loc:
    [B + 1] int32. Returns [T, H, D].

    num_splits: None picks split-KV by a heuristic; 1 forces the single pass; n > 1 forces
    split-KV with n parts.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert k_cache.shape[3] == row_width(head_dim, k_cache.dtype) and v_cache.stride() == k_cache.stride()
    assert v_cache.dtype == k_cache.dtype
    assert v_cache.shape == k_cache.shape and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert num_heads % num_kv_heads == 0
    assert query_start_loc.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    assert sliding_window is None or sliding_window > 0
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    q = keys_for(q, k_cache.dtype).to(q.dtype)  # an int8 cache's keys are rotated (cache.py): so are the queries

    group = num_heads // num_kv_heads
    # Decode-only steps (one query per request) get the smallest tile tl.dot accepts, so a
    # program is not mostly padding; prefill chunks get taller tiles to reuse each K/V tile.
    block_m = max(16 if num_tokens == num_seqs else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    block_d = triton.next_power_of_2(head_dim)
    # sm_90 builds of the 64 x 128 tile spill registers at 4 warps and not at 8.
    num_warps = 8 if block_m * block_d >= 64 * 128 else 4
    num_q_blocks = num_tokens // block_q + num_seqs
    if num_splits is None:  # the interpreter (CPU) gains nothing from splitting
        num_splits = choose_num_splits(_num_sms(q.device), num_q_blocks * num_kv_heads,
                                       block_tables.shape[1] * block_size) if q.is_cuda else 1
    assert num_splits >= 1

    if num_splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim,
                               dtype=torch.float32, device=q.device)
        part_m = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused: the kernel writes out directly

    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_acc, part_m, part_l,
        block_tables, seq_lens, query_start_loc,
        scale * _LOG2E, sliding_window or 0, num_seqs, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=TILE_N,
        NUM_SPLITS=num_splits, USE_WINDOW=sliding_window is not None, DOT_DTYPE=_dot_dtype(q),
        QUANTIZED=k_cache.dtype == torch.int8, num_warps=num_warps,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens,)](
            part_acc, part_m, part_l, out, out.stride(0), out.stride(1), num_heads,
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=block_d,
        )
    return out
