"""Each Triton kernel against its torch reference twin.

On a machine without CUDA the kernels run in the Triton interpreter (conftest sets it), so
shapes stay small: few heads, short sequences, and a chosen subset of the cross product of
block size x head dim x GQA ratio x batch mix x window x split-KV x dtype, where each value
appears in several combinations, rather than all of it.
"""
import dis
import functools
import itertools
import types

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from process_support import fresh_process_output

from trillm.kernels import activation, attention, cache, norm, rotary
from trillm.kernels import activation_triton, attention_triton, cache_triton, lora_triton, norm_triton, rotary_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA_CHECK = pytest.mark.cuda(cpu_too=True)  # the Triton kernels: on the device there, in the interpreter here
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Both sides compute in fp32; they differ only by output rounding (and, for attention on a
# GPU, by the probabilities rounded to the input dtype before the P @ V product).
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}
POISON = 1e3  # fills every cache slot no request owns: reading one shows as a large error


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def assert_close(got, want, dtype):
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


# --- norm, activation ----------------------------------------------------------------------


@CUDA_CHECK
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])  # 96: the block is wider than the row
def test_rms_norm(dtype, hidden):
    x, w = randn(5, hidden, dtype=dtype), randn(hidden, seed=1)
    assert_close(norm_triton.rms_norm(x, w, 1e-5), norm.rms_norm(x, w, 1e-5), dtype)


@CUDA_CHECK
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_fused_add_rms_norm(dtype, hidden):
    x, r, w = randn(5, hidden, dtype=dtype), randn(5, hidden, dtype=dtype, seed=1), randn(hidden, seed=2)
    got_out, got_res = norm_triton.fused_add_rms_norm(x, r, w, 1e-6)
    want_out, want_res = norm.fused_add_rms_norm(x, r, w, 1e-6)
    assert got_res.dtype == dtype and got_out.dtype == dtype
    assert_close(got_res, want_res, dtype)
    assert_close(got_out, want_out, dtype)


@CUDA_CHECK
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 1100])  # 1100: two column blocks, the last one partial
@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_activation_and_mul(dtype, inter, op):
    x = randn(3, 2 * inter, dtype=dtype) * 3  # GELU's tail and its curve both
    got = getattr(activation_triton, op)(x)
    assert got.shape == (3, inter)
    assert_close(got, getattr(activation, op)(x), dtype)


# --- rotary --------------------------------------------------------------------------------


@CUDA_CHECK
@pytest.mark.parametrize(
    "dtype,head_dim,is_neox",
    [
        (torch.float32, 64, True),
        (torch.float32, 128, False),
        (torch.float16, 128, True),
        (torch.bfloat16, 64, False),
        (torch.bfloat16, 128, True),
    ],
)
def test_rotary_embedding(dtype, head_dim, is_neox):
    num_tokens, hq, hk = 6, 3, 1
    # q and k are slices of one fused projection, as the model produces them: strided views.
    qkv = randn(num_tokens, (hq + 2 * hk) * head_dim, dtype=dtype)
    q = qkv[:, : hq * head_dim].view(num_tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(num_tokens, hk, head_dim)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(64, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(DEVICE)
    positions = torch.tensor([0, 5, 63, 7, 7, 30], device=DEVICE)
    q_ref, k_ref, v_before = q.clone(), k.clone(), qkv[:, (hq + hk) * head_dim :].clone()
    rotary.rotary_embedding(positions, q_ref, k_ref, cos_sin, is_neox)
    rotary_triton.rotary_embedding(positions, q, k, cos_sin, is_neox)
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    assert torch.equal(qkv[:, (hq + hk) * head_dim :], v_before)  # the v slice is untouched


# --- KV cache write ------------------------------------------------------------------------


@CUDA_CHECK
@pytest.mark.parametrize("dtype,block_size,head_dim", [(torch.float32, 16, 64), (torch.float16, 32, 128), (torch.bfloat16, 16, 128)])
def test_write_kv(dtype, block_size, head_dim):
    hk, num_blocks = 2, 4
    k, v = randn(7, hk, head_dim, dtype=dtype), randn(7, hk, head_dim, dtype=dtype, seed=1)
    # Out of order, across blocks, with padding rows (negative slots) in between.
    slots = torch.tensor([3, -1, block_size + 1, 2 * block_size - 1, -1, 0, 3 * block_size + 5], device=DEVICE)
    caches = [randn(num_blocks, block_size, hk, head_dim, dtype=dtype, seed=s) for s in (2, 3)]
    want = [c.clone() for c in caches]
    cache.write_kv(k, v, *want, slots)
    cache_triton.write_kv(k, v, *caches, slots)
    for got, ref in zip(caches, want):
        torch.testing.assert_close(got, ref, atol=0, rtol=0)  # a copy: bit-exact


@CUDA_CHECK
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_into_an_int8_cache(dtype):
    """Rows of any dtype quantized exactly as the twin quantizes them: the same int8 values
    (rounded to nearest even: a row with scale 1 below holds the halfway cases) and fp16 scales;
    a row of zeros gets scale 0."""
    hk, head_dim, block_size, num_blocks = 2, 64, 16, 4
    k, v = randn(7, hk, head_dim, dtype=dtype), randn(7, hk, head_dim, dtype=dtype, seed=1)
    k[2, 1] = 0.0
    v[3, 0, :8] = torch.tensor([127.0, 0.5, 1.5, -2.5, 63.5, -0.5, 3.5, 126.5])
    slots = torch.tensor([3, -1, block_size + 1, 2 * block_size - 1, -1, 0, 3 * block_size + 5], device=DEVICE)
    caches = [cache.to_cache(randn(num_blocks, block_size, hk, head_dim, seed=s), torch.int8) for s in (2, 3)]
    want = [c.clone() for c in caches]
    cache.write_kv(k, v, *want, slots)
    cache_triton.write_kv(k, v, *caches, slots)
    for got, ref in zip(caches, want):
        assert torch.equal(got, ref)
    assert torch.equal(cache.from_cache(want[1].view(-1, hk, head_dim + 2)[2 * block_size - 1, 0])[:8],
                       torch.tensor([127.0, 0.0, 2.0, -2.0, 64.0, 0.0, 4.0, 126.0], device=DEVICE))


def test_key_rotation_is_an_orthogonal_walsh_hadamard_transform():
    """cache.rotate_rows (the kernels' kv_rotate, bit for bit by the write tests) is the
    normalized Walsh-Hadamard matrix: entries +-1 / sqrt(D), orthogonal, its own inverse; a
    head_dim that is not a power of two is left as it is."""
    rotation = cache.rotate_rows(torch.eye(64))
    assert torch.equal(rotation.abs(), torch.full((64, 64), 0.125))
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(64), atol=1e-6, rtol=0)
    x = randn(5, 64)
    torch.testing.assert_close(cache.rotate_rows(cache.rotate_rows(x)), x, atol=1e-5, rtol=0)
    assert torch.equal(cache.rotate_rows(randn(3, 44)), randn(3, 44))


def test_an_int8_cache_spreads_a_key_outlier_channel_over_the_row():
    """Keys whose one channel is far larger than the rest, as real keys have: quantized as they
    are, one scale per row sized to that channel leaves the others a step or two, and attention
    scores move by far more than on the rotated rows the cache keeps. The compiled write and
    attention against an fp32 cache: at most a third of the unrotated rows' error."""
    from trillm.kernels import attention_cpu, ops_cpu

    head_dim, n = 64, 48
    k = randn(n, 1, head_dim) * 0.3
    k[..., 5] += 40.0
    v = randn(n, 1, head_dim, seed=1)
    q = randn(1, 2, head_dim, seed=2)
    tables, lens, scale = torch.arange(3, dtype=torch.int32)[None], torch.tensor([n], dtype=torch.int32), 0.125
    outs = {}
    for dtype in (torch.float32, torch.int8):
        caches = [torch.zeros(3, 16, 1, cache.row_width(head_dim, dtype), dtype=dtype) for _ in range(2)]
        ops_cpu.write_kv(k, v, *caches, torch.arange(n))
        outs[dtype] = attention_cpu.paged_attention(q, *caches, tables, lens, None, scale)
    unrotated = cache.dequantize_rows(cache.quantize_rows(k))  # what one scale per unrotated row keeps
    plain = torch.softmax(scale * torch.einsum("hd,nd->hn", q[0], unrotated[:, 0]), -1) @ v[:, 0]
    error = (outs[torch.int8] - outs[torch.float32]).abs().max()
    assert error < (plain - outs[torch.float32][0]).abs().max() / 3, error


# --- paged attention -----------------------------------------------------------------------


def make_batch(num_queries, seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=0):
    """A paged KV cache holding each request's context in shuffled blocks, every slot that no
    request owns poisoned, block tables padded with a poisoned block, and query_start_loc."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    width = max(blocks_per_seq) + 1  # one spare column: padding the kernel must not follow
    num_blocks = sum(blocks_per_seq) + 2
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 stays poison
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, POISON), torch.full(shape, POISON)
    for b, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[b, :nb] = torch.tensor([ids.pop() for _ in range(nb)])
        pos = torch.arange(n)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(n, num_kv_heads, head_dim, generator=g)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(n, num_kv_heads, head_dim, generator=g)
    starts = torch.tensor([0, *num_queries]).cumsum(0).to(torch.int32)
    to = dict(device=DEVICE)
    return (
        k_cache.to(dtype=dtype, **to), v_cache.to(dtype=dtype, **to), block_tables.to(**to),
        torch.tensor(seq_lens, dtype=torch.int32, **to), starts.to(**to),
    )


def check_attention(num_queries, seq_lens, *, block_size=16, head_dim=64, num_kv_heads=2, group=1,
                    dtype=torch.float32, sliding_window=None, num_splits=1, seed=0, cache_dtype=None):
    """The Triton kernel against the twin; the cache in the queries' dtype, or in cache_dtype."""
    assert all(0 < nq <= n for nq, n in zip(num_queries, seq_lens))
    made = dtype if cache_dtype is None else torch.float32
    k_cache, v_cache, block_tables, lens, starts = make_batch(
        num_queries, seq_lens, block_size, num_kv_heads, head_dim, made, seed)
    if cache_dtype is not None:
        k_cache, v_cache = cache.to_cache(k_cache, cache_dtype), cache.to_cache(v_cache, cache_dtype)
    num_heads = num_kv_heads * group
    q = randn(sum(num_queries), num_heads, head_dim, dtype=dtype, seed=seed + 1)
    args = (q, k_cache, v_cache, block_tables, lens, starts, head_dim**-0.5, sliding_window)
    want = attention.paged_attention(*args)
    got = attention_triton.paged_attention(*args, num_splits=num_splits)
    assert got.shape == q.shape and got.dtype == dtype
    assert_close(got, want, dtype)


BATCHES = {  # (queries per request, context length per request)
    "decode": ([1, 1, 1, 1], [1, 17, 40, 33]),  # lengths: 1 token, mid-block, block edges
    "prefill": ([12, 70], [12, 70]),  # whole prompts; 70 queries span two 64-row q tiles
    # A prefill chunk starting mid-block, a prefix-cache hit (32 cached, 9 new), decodes.
    "mixed": ([1, 20, 9, 1, 3], [50, 45, 41, 7, 3]),
}


@CUDA_CHECK
@pytest.mark.parametrize(
    "batch,block_size,head_dim,group,sliding_window,num_splits,dtype",
    [
        ("decode", 16, 64, 1, None, 1, torch.float32),
        ("decode", 32, 128, 8, None, 4, torch.bfloat16),
        ("decode", 16, 64, 3, 9, 3, torch.float16),  # window 9: the 40-token request starts at key 31
        ("prefill", 16, 64, 3, None, 1, torch.float16),
        ("prefill", 32, 64, 1, 20, 1, torch.float32),
        ("prefill", 16, 128, 8, 9, 2, torch.bfloat16),
        ("mixed", 16, 64, 8, None, 1, torch.float32),
        ("mixed", 32, 64, 3, None, 2, torch.float32),
        ("mixed", 16, 128, 1, 16, 1, torch.bfloat16),
        ("mixed", 32, 128, 3, 5, 3, torch.float16),
    ],
)
def test_paged_attention(batch, block_size, head_dim, group, sliding_window, num_splits, dtype):
    check_attention(*BATCHES[batch], block_size=block_size, head_dim=head_dim, group=group,
                    sliding_window=sliding_window, num_splits=num_splits, dtype=dtype)


@CUDA_CHECK
@pytest.mark.parametrize(
    "batch,dtype,sliding_window,num_splits",
    [("decode", torch.float32, None, 3), ("prefill", torch.bfloat16, None, 1), ("mixed", torch.float16, 5, 1),
     ("mixed", torch.float32, None, 2)],
)
def test_paged_attention_on_an_int8_cache(batch, dtype, sliding_window, num_splits):
    """int8 rows and their scales, dequantized in the kernel, as the twin dequantizes them."""
    check_attention(*BATCHES[batch], group=3, dtype=dtype, sliding_window=sliding_window, num_splits=num_splits,
                    cache_dtype=torch.int8)


@CUDA_CHECK
def test_paged_attention_more_splits_than_tiles():
    """Splits beyond the KV a request has must contribute nothing (empty partials)."""
    check_attention([1, 2], [5, 40], num_splits=8)


@CUDA_CHECK
def test_paged_attention_strided_query():
    """q as a slice of a fused qkv projection, not contiguous across tokens."""
    k_cache, v_cache, block_tables, lens, starts = make_batch(*BATCHES["mixed"], 16, 2, 64, torch.float32)
    qkv = randn(sum(BATCHES["mixed"][0]), 8 * 64, seed=1)
    q = qkv[:, : 4 * 64].view(-1, 4, 64)
    args = (q, k_cache, v_cache, block_tables, lens, starts, 0.125)
    assert_close(attention_triton.paged_attention(*args), attention.paged_attention(*args), torch.float32)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_torch_backends_plan_attention_once_per_step(backend_name):
    """Every layer of a step reuses one plan per sliding window, and attends as the reference does
    (the cpu family through its compiled decode kernel for the decode rows of the mixed batch)."""
    from trillm.kernels.attention_metadata import AttentionMetadata
    from trillm.kernels.family import get_kernels

    num_queries, seq_lens = BATCHES["mixed"]
    k_cache, v_cache, block_tables, lens, starts = (
        t.cpu() for t in make_batch(num_queries, seq_lens, 16, 2, 64, torch.float32))
    slot_mapping = torch.full((sum(num_queries),), -1, dtype=torch.int64)  # write nothing
    meta = AttentionMetadata(slot_mapping, block_tables, lens, starts, max(seq_lens), max(num_queries))
    backend = get_kernels(backend_name, torch.device("cpu"), torch.float32)
    q = randn(sum(num_queries), 4, 64, seed=1).cpu()
    kv = randn(sum(num_queries), 2, 64, seed=2).cpu()
    for window in (None, None, 9, 9):  # four layers, two of them sliding
        got = backend.attend(q, kv, kv, k_cache, v_cache, meta, 0.125, window)
        assert_close(got, attention.paged_attention(q, k_cache, v_cache, block_tables, lens, starts, 0.125, window),
                     torch.float32)
    assert len(meta.per_step) == 2


def test_choose_num_splits():
    choose = attention_triton.choose_num_splits
    assert choose(num_sms=132, num_programs=8, max_context=8192) == attention_triton.MAX_SPLITS
    assert choose(num_sms=132, num_programs=64, max_context=8192) == 5  # ~2 programs per SM
    assert choose(num_sms=132, num_programs=8, max_context=768) == 3  # >= 256 keys per split
    assert choose(num_sms=132, num_programs=8, max_context=200) == 1  # too little KV to share
    assert choose(num_sms=132, num_programs=132, max_context=8192) == 1  # the grid fills the GPU


@st.composite
def ragged_batches(draw):
    """Requests with 1..40 context tokens, each with 1..all of them as new queries."""
    seq_lens = draw(st.lists(st.integers(1, 40), min_size=1, max_size=5))
    num_queries = [draw(st.sampled_from([1, draw(st.integers(1, n))])) for n in seq_lens]
    return num_queries, seq_lens


@CUDA_CHECK
@settings(max_examples=12, deadline=None)
@given(
    batch=ragged_batches(),
    block_size=st.sampled_from([16, 32]),
    group=st.sampled_from([1, 3, 8]),
    sliding_window=st.sampled_from([None, 1, 7, 33]),
    num_splits=st.sampled_from([1, 2, 5]),
)
def test_paged_attention_ragged(batch, block_size, group, sliding_window, num_splits):
    check_attention(*batch, block_size=block_size, group=group, num_kv_heads=1,
                    sliding_window=sliding_window, num_splits=num_splits)


# --- the cpu family: compiled decode attention, packed linears ------------------------------


CPU_CACHE_DTYPES = [torch.float32, torch.float16, torch.int8]  # int8: rows and scales (cache.py)


def check_cpu_decode_attention(seq_lens, *, block_size=16, head_dim=64, num_kv_heads=2, group=1,
                               sliding_window=None, seed=0, cache_dtype=torch.float32, threads=1, lanes=0):
    """The compiled decode kernel against the torch twin, on a cache (fp32, fp16 or int8) whose unowned
    slots are poison, on one thread or shared among the pool's, in `lanes` lanes (0: the widest)."""
    from trillm.kernels import pool_cpu
    from trillm.kernels.attention_cpu import paged_attention

    k_cache, v_cache, block_tables, lens, starts = (t.cpu() for t in make_batch(
        [1] * len(seq_lens), seq_lens, block_size, num_kv_heads, head_dim, torch.float32, seed))
    k_cache, v_cache = cache.to_cache(k_cache, cache_dtype), cache.to_cache(v_cache, cache_dtype)
    q = randn(len(seq_lens), num_kv_heads * group, head_dim, seed=seed + 1).cpu()
    scale = head_dim**-0.5
    want = attention.paged_attention(q, k_cache, v_cache, block_tables, lens, starts, scale, sliding_window)
    previous = pool_cpu.set_threads(threads)
    try:
        got = paged_attention(q, k_cache, v_cache, block_tables, lens, None, scale, sliding_window, lanes)
    finally:
        pool_cpu.set_threads(previous)
    assert got.shape == q.shape and got.dtype == torch.float32
    assert_close(got, want, torch.float32)


def cpu_lane_widths() -> list[int]:
    """The widths the compiled attention runs in here (an AVX-512 CPU has both)."""
    from trillm.kernels.attention_cpu import lane_widths

    return lane_widths()


@pytest.mark.parametrize("lanes", [16, 8])
@pytest.mark.parametrize("cache_dtype", CPU_CACHE_DTYPES)
@pytest.mark.parametrize(
    "block_size,head_dim,group,num_kv_heads,sliding_window",
    [(16, 64, 1, 2, None), (16, 64, 3, 3, None), (32, 128, 8, 1, None), (16, 64, 3, 2, 9), (32, 64, 1, 4, 1),
     (16, 44, 4, 2, None)],  # 44: a vector body, an 8-lane one and a tail of 4 in each width
)
def test_cpu_decode_attention(block_size, head_dim, group, num_kv_heads, sliding_window, cache_dtype, lanes):
    if lanes not in cpu_lane_widths():
        pytest.skip(f"this CPU has no {lanes}-lane attention")
    check_cpu_decode_attention([1, 17, 40, 33, 64, 200], block_size=block_size, head_dim=head_dim, group=group,
                               num_kv_heads=num_kv_heads, sliding_window=sliding_window, cache_dtype=cache_dtype,
                               lanes=lanes)


@settings(max_examples=30, deadline=None)
@given(
    seq_lens=st.lists(st.integers(1, 70), min_size=1, max_size=9),
    block_size=st.sampled_from([16, 32]),
    group=st.sampled_from([1, 3, 8]),
    sliding_window=st.sampled_from([None, 1, 7, 33]),
    cache_dtype=st.sampled_from(CPU_CACHE_DTYPES),
    threads=st.sampled_from([1, 2]),
    lanes=st.sampled_from([16, 8]),
)
def test_cpu_decode_attention_ragged(seq_lens, block_size, group, sliding_window, cache_dtype, threads, lanes):
    assume(lanes in cpu_lane_widths())
    check_cpu_decode_attention(seq_lens, block_size=block_size, group=group, num_kv_heads=1,
                               sliding_window=sliding_window, cache_dtype=cache_dtype, threads=threads, lanes=lanes)


@pytest.mark.parametrize("lanes", [16, 8])
@pytest.mark.parametrize("cache_dtype", CPU_CACHE_DTYPES)
@pytest.mark.parametrize("num_kv_heads,group,threads", [(2, 1, 1), (5, 3, 1), (5, 1, 2), (12, 2, 2)])
def test_cpu_decode_attention_cuts_a_lone_row_by_kv_heads_to_the_same_bits(num_kv_heads, group, threads,
                                                                           cache_dtype, lanes):
    """One stream decoding is one tile, which the kernel cuts by KV heads among the pool's pieces
    (4, 5 heads: uneven parts; 12: more heads than pieces): each request's row computes the same
    bits alone, cut, as in a step of more rows than pieces, where no tile is cut."""
    if lanes not in cpu_lane_widths():
        pytest.skip(f"this CPU has no {lanes}-lane attention")
    from trillm.kernels import pool_cpu
    from trillm.kernels.attention_cpu import paged_attention

    seq_lens = [70, 3, 41, 16, 1, 33, 128, 9, 64]  # more rows than two threads' pieces
    k_cache, v_cache, tables, lens, starts = (t.cpu() for t in make_batch(
        [1] * len(seq_lens), seq_lens, 16, num_kv_heads, 64, torch.float32, 5))
    k_cache, v_cache = cache.to_cache(k_cache, cache_dtype), cache.to_cache(v_cache, cache_dtype)
    q = randn(len(seq_lens), num_kv_heads * group, 64, seed=6).cpu()
    previous = pool_cpu.set_threads(threads)
    try:
        batched = paged_attention(q, k_cache, v_cache, tables, lens, None, 0.125, None, lanes)
        alone = torch.cat([paged_attention(q[b:b + 1].contiguous(), k_cache, v_cache, tables[b:b + 1].contiguous(),
                                           lens[b:b + 1].contiguous(), None, 0.125, None, lanes)
                           for b in range(len(seq_lens))])
    finally:
        pool_cpu.set_threads(previous)
    assert torch.equal(alone, batched)
    assert_close(batched, attention.paged_attention(q, k_cache, v_cache, tables, lens, starts, 0.125, None),
                 torch.float32)


@settings(max_examples=25, deadline=None)
@given(
    batch=ragged_batches(),
    block_size=st.sampled_from([16, 32]),
    group=st.sampled_from([1, 3]),
    sliding_window=st.sampled_from([None, 1, 7, 33]),
    cache_dtype=st.sampled_from(CPU_CACHE_DTYPES),
)
def test_cpu_row_attention_matches_the_twin_on_mixed_steps(batch, block_size, group, sliding_window, cache_dtype):
    """The cpu family's plan: every row of prefill chunks and decodes through the compiled kernel,
    each as a query at its own position; the same output as the twin's gather and SDPA."""
    from trillm.kernels.attention_cpu import paged_attention

    num_queries, seq_lens = batch
    k_cache, v_cache, block_tables, lens, starts = (t.cpu() for t in make_batch(
        num_queries, seq_lens, block_size, 2, 64, torch.float32, 0))
    k_cache, v_cache = cache.to_cache(k_cache, cache_dtype), cache.to_cache(v_cache, cache_dtype)
    q = randn(sum(num_queries), 2 * group, 64, seed=1).cpu()
    want = attention.paged_attention(q, k_cache, v_cache, block_tables, lens, starts, 0.125, sliding_window)
    plan = attention.plan_attention(block_tables, lens, starts, block_size, sliding_window, paged_attention)
    assert plan.single_group and len(plan.groups) == 1
    assert_close(attention.attend_planned(q, k_cache, v_cache, plan, 0.125), want, torch.float32)


def test_cpu_attention_refuses_what_it_cannot_read():
    from trillm.kernels.attention_cpu import paged_attention

    k_cache, v_cache, block_tables, lens, starts = (t.cpu() for t in make_batch([1], [5], 16, 1, 64, torch.float32))
    q = torch.randn(1, 1, 64)
    for bad in (q.to(torch.bfloat16), torch.randn(1, 1, 128)[..., ::2]):  # wrong dtype, not contiguous
        with pytest.raises(AssertionError):
            paged_attention(bad, k_cache, v_cache, block_tables, lens, None, 0.125)
    with pytest.raises(AssertionError):
        paged_attention(q, k_cache, v_cache, block_tables.long(), lens, None, 0.125)
    with pytest.raises(AssertionError):  # a vector width no CPU runs it in
        paged_attention(q, k_cache, v_cache, block_tables, lens, None, 0.125, None, 32)
    with pytest.raises(AssertionError):  # query_start_loc that does not end at the rows given
        paged_attention(q, k_cache, v_cache, block_tables, lens, torch.tensor([0, 2], dtype=torch.int32), 0.125)
    # more query rows than the request's context: positions before 0, which the kernel must not read
    six = torch.randn(6, 1, 64)
    with pytest.raises(ValueError, match="more rows than its context"):
        paged_attention(six, k_cache, v_cache, block_tables, lens, torch.tensor([0, 6], dtype=torch.int32), 0.125)


@settings(max_examples=25, deadline=None)
@given(
    context=st.integers(1, 90),
    cached=st.integers(0, 89),
    chunk=st.integers(1, 40),
    group=st.sampled_from([1, 3]),
    sliding_window=st.sampled_from([None, 5, 33]),
    cache_dtype=st.sampled_from(CPU_CACHE_DTYPES),
    threads=st.sampled_from([1, 2]),
    lanes=st.sampled_from([16, 8]),
)
def test_cpu_attention_gives_a_prompt_the_same_bits_however_its_rows_are_tiled(
        context, cached, chunk, group, sliding_window, cache_dtype, threads, lanes):
    """A prompt's rows computed whole, in chunks after a cached prefix, beside another request,
    and one at a time as decode rows: the same output to the bit (the kernel's rows go in tiles
    whose makeup changes with each of these, and must not change a row's arithmetic), in each
    vector width."""
    assume(lanes in cpu_lane_widths())
    from trillm.kernels import pool_cpu
    from trillm.kernels.attention_cpu import paged_attention

    cached = min(cached, context - 1)
    k_cache, v_cache, tables, lens, _ = (t.cpu() for t in make_batch([1], [context], 16, 2, 64, torch.float32))
    k_cache, v_cache = cache.to_cache(k_cache, cache_dtype), cache.to_cache(v_cache, cache_dtype)
    q = randn(context, 2 * group, 64, seed=3).cpu()

    def attend(rows: slice, neighbour: bool = False):
        """Rows `rows` of the prompt as one request's chunk (its context ending at the last of them)."""
        seq_lens = torch.tensor([rows.stop], dtype=torch.int32)
        starts = torch.tensor([0, rows.stop - rows.start], dtype=torch.int32)
        q_rows, block_tables = q[rows], tables
        if neighbour:  # a second request, the whole prompt again, ahead of this one in the step
            q_rows = torch.cat([q, q_rows])
            block_tables = torch.cat([tables, tables])
            seq_lens = torch.tensor([context, rows.stop], dtype=torch.int32)
            starts = torch.tensor([0, context, context + rows.stop - rows.start], dtype=torch.int32)
        out = paged_attention(q_rows.contiguous(), k_cache, v_cache, block_tables, seq_lens, starts, 0.125,
                              sliding_window, lanes)
        return out[-(rows.stop - rows.start):]

    previous = pool_cpu.set_threads(threads)
    try:
        whole = attend(slice(0, context))
        chunked = torch.cat([attend(slice(s, min(s + chunk, context)))
                             for s in range(cached, context, chunk)])
        beside = attend(slice(cached, context), neighbour=True)
        decoded = torch.cat([paged_attention(q[i:i + 1].contiguous(), k_cache, v_cache, tables,
                                             torch.tensor([i + 1], dtype=torch.int32), None, 0.125, sliding_window,
                                             lanes)
                             for i in range(cached, context)])
    finally:
        pool_cpu.set_threads(previous)
    assert torch.equal(chunked, whole[cached:]) and torch.equal(beside, whole[cached:])
    assert torch.equal(decoded, whole[cached:])
    want = attention.paged_attention(q, k_cache, v_cache, tables, lens,
                                     torch.tensor([0, context], dtype=torch.int32), 0.125, sliding_window)
    assert_close(whole, want, torch.float32)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), hidden=st.integers(1, 200), row_gap=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_cpu_norms_match_their_twins(rows, hidden, row_gap, seed):
    """Any width (vector bodies and tails), and rows strided as a slice of a wider output is."""
    from trillm.kernels import ops_cpu

    x = randn(rows, hidden + row_gap, seed=seed)[:, :hidden]
    residual, weight = randn(rows, hidden, seed=seed + 1), randn(hidden, seed=seed + 2)
    assert_close(ops_cpu.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6), torch.float32)
    got, want = ops_cpu.fused_add_rms_norm(x, residual, weight, 1e-5), norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert_close(got[0], want[0], torch.float32)
    assert torch.equal(got[1], want[1])  # the next residual is one rounded add, as in the twin


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), inter=st.integers(1, 300), scale=st.sampled_from([1.0, 30.0]), seed=st.integers(0, 2**16))
def test_cpu_silu_and_gelu_and_mul_match_their_twins(rows, inter, scale, seed):
    """scale 30: gates far out on both sides, where exp is clamped."""
    from trillm.kernels import ops_cpu

    x = randn(rows, 2 * inter, seed=seed) * scale
    assert_close(ops_cpu.silu_and_mul(x), activation.silu_and_mul(x), torch.float32)
    assert_close(ops_cpu.gelu_tanh_and_mul(x), activation.gelu_tanh_and_mul(x), torch.float32)


@pytest.mark.parametrize("head_dim,is_neox", [(64, True), (128, True), (64, False), (6, True)])
def test_cpu_rotary_embedding_matches_its_twin(head_dim, is_neox):
    """In place on strided q and k views of one fused projection; the v slice stays as it was."""
    from trillm.kernels import ops_cpu

    num_tokens, hq, hk = 6, 3, 1
    qkv = randn(num_tokens, (hq + 2 * hk) * head_dim)
    q = qkv[:, : hq * head_dim].view(num_tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(num_tokens, hk, head_dim)
    cos_sin = randn(64, head_dim, seed=1)
    positions = torch.tensor([0, 5, 63, 7, 7, 30])
    q_ref, k_ref, v_before = q.clone(), k.clone(), qkv[:, (hq + hk) * head_dim :].clone()
    rotary.rotary_embedding(positions, q_ref, k_ref, cos_sin, is_neox)
    ops_cpu.rotary_embedding(positions, q, k, cos_sin, is_neox)
    assert_close(q, q_ref, torch.float32)
    assert_close(k, k_ref, torch.float32)
    assert torch.equal(qkv[:, (hq + hk) * head_dim :], v_before)
    with pytest.raises(IndexError):  # past the table: refused before anything is rotated
        ops_cpu.rotary_embedding(torch.tensor([0, 5, 64, 7, 7, 30]), q, k, cos_sin, is_neox)
    assert_close(q, q_ref, torch.float32)


@pytest.mark.parametrize("cache_dtype", CPU_CACHE_DTYPES)
def test_cpu_row_ops_cut_among_threads_give_one_threads_bits(cache_dtype):
    """A prompt's rows are cut among the pool's threads (shared_cpu.h's rows_run, at least 16,384
    elements a piece): each op, and the int8 linear's quantized activations, must give the bits one
    thread gives, and a bad position or slot in the last piece must still stop the whole op."""
    from trillm.kernels import ops_cpu, pool_cpu, quant, quant_cpu

    rows, hk, head_dim, block_size = 301, 4, 64, 16  # 77,056 elements a row op: several pieces
    x, residual, weight = randn(rows, 1024, seed=1), randn(rows, 1024, seed=2), randn(1024, seed=3)
    gate_up = randn(rows, 2 * 1024, seed=4) * 4
    qkv = randn(rows, 3 * hk * head_dim, seed=5)
    positions = torch.randint(0, 512, (rows,), generator=torch.Generator().manual_seed(6))
    cos_sin = randn(512, head_dim, seed=7)
    slots = torch.randperm(rows + 40, generator=torch.Generator().manual_seed(8))[:rows]
    slots[::7] = -1  # padding rows, skipped
    linear = quant_cpu.Int8QuantizedLinear(quant.from_gguf("q4_1", random_gguf_blocks("q4_1", 64, 1024, seed=9)))

    def run(threads):
        previous = pool_cpu.set_threads(threads)
        try:
            q_and_k = qkv.clone()
            q = q_and_k[:, : 2 * hk * head_dim].view(rows, 2 * hk, head_dim)
            k = q_and_k[:, 2 * hk * head_dim :].view(rows, hk, head_dim)
            ops_cpu.rotary_embedding(positions, q, k, cos_sin, True)
            caches = [cache.to_cache(torch.zeros(rows // block_size + 4, block_size, hk, head_dim), cache_dtype)
                      for _ in range(2)]
            ops_cpu.write_kv(k, k * 0.5, *caches, slots)
            return [ops_cpu.rms_norm(x, weight, 1e-6), *ops_cpu.fused_add_rms_norm(x, residual, weight, 1e-6),
                    ops_cpu.silu_and_mul(gate_up), ops_cpu.gelu_tanh_and_mul(gate_up), q_and_k, *caches, linear(x)]
        finally:
            pool_cpu.set_threads(previous)

    one, two = run(1), run(2)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    assert_close(one[0], norm.rms_norm(x, weight, 1e-6), torch.float32)
    assert_close(one[3], activation.silu_and_mul(gate_up), torch.float32)
    previous = pool_cpu.set_threads(2)
    try:
        before = qkv.clone()
        q, k = before[:, :128].view(rows, 2, head_dim), before[:, 128:256].view(rows, 2, head_dim)
        with pytest.raises(IndexError):  # the last row's position is past the table: nothing rotated
            ops_cpu.rotary_embedding(torch.cat([positions[:-1], torch.tensor([512])]), q, k, cos_sin, True)
        assert torch.equal(before, qkv)
        caches = [cache.to_cache(torch.zeros(rows // block_size + 4, block_size, hk, head_dim), cache_dtype)
                  for _ in range(2)]
        k = qkv[:, :256].view(rows, hk, head_dim)
        with pytest.raises(IndexError):  # the last row's slot is past the cache: nothing written
            ops_cpu.write_kv(k, k, *caches, torch.cat([slots[:-1], torch.tensor([10**6])]))
        assert all(not c.any() for c in caches)
    finally:
        pool_cpu.set_threads(previous)


@pytest.mark.parametrize("cache_dtype", CPU_CACHE_DTYPES)
def test_cpu_write_kv_matches_its_twin(cache_dtype):
    """fp32 rows copied, rounded to fp16 exactly as torch's .to() rounds them (to nearest even:
    the values below include halfway cases and ones past fp16's range), or quantized to int8 rows
    and scales exactly as cache.quantize_rows makes them (a row of zeros, values on halves)."""
    from trillm.kernels import ops_cpu

    block_size, hk, head_dim, num_blocks = 16, 2, 64, 4
    kv = randn(7, 3 * hk * head_dim)  # k and v as strided views of one fused projection
    kv[0, :4] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 70000.0, -1e-8])
    k = kv[:, hk * head_dim : 2 * hk * head_dim].view(7, hk, head_dim)
    v = kv[:, 2 * hk * head_dim :].view(7, hk, head_dim)
    k[0, 0, :4] = kv[0, :4]
    k[2, 1] = 0.0
    v[3, 0, :8] = torch.tensor([127.0, 0.5, 1.5, -2.5, 63.5, -0.5, 3.5, 126.5])  # scale 1: ties to even
    slots = torch.tensor([3, -1, block_size + 1, 2 * block_size - 1, -1, 0, 3 * block_size + 5])
    caches = [cache.to_cache(randn(num_blocks, block_size, hk, head_dim, seed=s), cache_dtype) for s in (2, 3)]
    want = [c.clone() for c in caches]
    cache.write_kv(k, v, *want, slots)
    ops_cpu.write_kv(k, v, *caches, slots)
    for got, ref in zip(caches, want):
        assert torch.equal(got, ref)
    with pytest.raises(IndexError):  # a slot past the cache: refused before anything is written
        ops_cpu.write_kv(k, v, *caches, torch.tensor([0, 1, 2, 3, 4, 5, num_blocks * block_size]))
    with pytest.raises(AssertionError):  # fewer slots than rows: the kernel would read past them
        ops_cpu.write_kv(k, v, *caches, slots[:3])
    for got, ref in zip(caches, want):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8, 33, 256, 2100])
def test_packed_linear_matches_f_linear(dtype, rows):
    from trillm.kernels import linear_cpu

    if not linear_cpu.is_available(dtype):
        pytest.skip(f"oneDNN does not run {dtype} on this CPU")
    weight, bias = torch.randn(96, 80).to(dtype), torch.randn(96).to(dtype)
    x = torch.randn(rows, 80).to(dtype)
    packed = linear_cpu.pack(weight)
    for b in (None, bias):
        assert_close(linear_cpu.linear(x, packed, b), torch.nn.functional.linear(x, weight, b), dtype)
    strided = torch.randn(rows, 160).to(dtype)[:, ::2]  # a view, as a split of a fused projection is
    assert_close(linear_cpu.linear(strided, packed, bias), torch.nn.functional.linear(strided, weight, bias), dtype)


PACKED_ROWS_PROBE = """
import torch
from process_support import resident_bytes
from trillm.kernels import linear_cpu
packed, x = linear_cpu.pack(torch.randn(256, 128)), torch.randn(1000, 128)
before = resident_bytes()
for rows in range(1, len(x) + 1):
    linear_cpu.linear(x[:rows], packed, None)
print(resident_bytes() - before)
"""


def test_packed_linear_memory_stays_flat_over_every_row_count():
    """A server's steps come in every row count up to its token budget. oneDNN keeps what it
    builds for each row count it runs: run as they came, 1 to 1,000 rows grew a fresh process
    by 670 MiB or more. `linear` runs 64 counts up to 1,000 rows (run_rows): about 46."""
    from trillm.kernels import linear_cpu

    if not linear_cpu.is_available(torch.float32):
        pytest.skip("this torch has no oneDNN")
    assert int(fresh_process_output(PACKED_ROWS_PROBE)) < 96 << 20


def test_packed_linear_runs_few_row_counts():
    from trillm.kernels.linear_cpu import MAX_RUN_ROWS, run_rows

    counts = [run_rows(rows) for rows in range(1, MAX_RUN_ROWS + 1)]
    assert len(set(counts)) == 72 and max(counts) == MAX_RUN_ROWS
    assert all(rows <= count <= rows * 1.125 for rows, count in enumerate(counts, 1))
    assert counts == sorted(counts)


# --- GGUF-quantized linears ----------------------------------------------------------------


def random_gguf_blocks(format: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Raw GGUF bytes of a [rows, cols] weight in `format`: random quants (and sub-block scales),
    small fp16 scales (and mins) where the format keeps them."""
    from trillm.kernels import quant

    values, nbytes = quant.GGUF_BLOCKS[format]
    halves = 2 if format in ("q4_1", "q5_1", "q4_k", "q5_k") else 1  # fp16 d (and m or dmin) at each block's start
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, cols // values, nbytes), generator=g, dtype=torch.uint8)
    fp16 = (torch.rand(rows, cols // values, 2, generator=g) * torch.tensor([0.02, -0.1])).half()
    at = nbytes - 2 if format == "q6_k" else 0  # Q6_K keeps its d last
    blocks[..., at : at + 2 * halves] = fp16[..., :halves].contiguous().view(torch.uint8)
    return blocks.reshape(rows, -1)


def kernel_weight(format: str, rows: int, cols: int, seed: int = 0):
    """A QuantizedWeight in one of the kernels' layouts: "q4_1", "q5_1", "q8_0", or
    "q5_1_as_bytes", a q5_1 weight promoted to q8_0 with mins (quant.as_bytes)."""
    from trillm.kernels import quant

    if format == "q5_1_as_bytes":
        return quant.as_bytes(quant.from_gguf("q5_1", random_gguf_blocks("q5_1", rows, cols, seed)))
    return quant.from_gguf(format, random_gguf_blocks(format, rows, cols, seed))


LAYOUTS = ["q4_1", "q5_1", "q8_0", "q5_1_as_bytes"]


@settings(max_examples=20, deadline=None)
@given(format=st.sampled_from(["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"]),
       rows=st.integers(1, 5), supers=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_gguf_blocks_dequantize_as_gguf_py(format, rows, supers, seed):
    """Every format read from a file, repacked into the kernels' four layouts: the twin's
    dequantization against gguf-py's own of the same bytes, to the bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from trillm.kernels import quant

    blocks = random_gguf_blocks(format, rows, 256 * supers, seed)
    want = torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType[format.upper()]))
    weight = quant.from_gguf(format, blocks)
    assert weight.format == {"q8_0": "q8_0", "q5_0": "q5_1", "q5_1": "q5_1", "q5_k": "q5_1", "q6_k": "q6_k"}.get(
        format, "q4_1")
    assert torch.equal(quant.dequantize(weight), want)


@settings(max_examples=20, deadline=None)
@given(format=st.sampled_from(["q4_0", "q8_0", "q4_k", "q5_k", "q6_k"]), rows=st.integers(1, 20),
       supers=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_the_kernels_repack_gguf_blocks_as_the_twin_does(format, rows, supers, seed):
    """quant_cpu.from_gguf (loading's repack, compiled loops for the K-quants' quants) makes
    quant.from_gguf's weight, every array to the bit."""
    from trillm.kernels import quant, quant_cpu

    blocks = random_gguf_blocks(format, rows, 256 * supers, seed)
    want, got = quant.from_gguf(format, blocks), quant_cpu.from_gguf(format, blocks)
    assert got.format == want.format
    for a, b in zip([*want[1:4], *(want.k_scales or ())], [*got[1:4], *(got.k_scales or ())]):
        assert (a is None and b is None) or torch.equal(a, b)


@settings(max_examples=25, deadline=None)
@given(format=st.sampled_from(LAYOUTS), rows=st.integers(1, 70), tiles=st.integers(1, 5),
       blocks=st.integers(1, 6), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_quantized_linear_matches_its_twin(format, rows, tiles, blocks, bias, seed):
    """Any row count (whole and partial groups of the kernel's 16 rows, several row tiles past
    64), any number of 16-output tiles and 32-input blocks, every layout."""
    from trillm.kernels import quant, quant_cpu

    weight = kernel_weight(format, 16 * tiles, 32 * blocks, seed)
    x = torch.randn(rows, 32 * blocks, generator=torch.Generator().manual_seed(seed))
    b = torch.randn(16 * tiles) if bias else None
    assert_close(quant_cpu.QuantizedLinear(weight)(x, b), quant.linear(x, weight, b), torch.float32)


@settings(max_examples=20, deadline=None)
@given(format=st.sampled_from(["q4_0", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k"]), tiles=st.integers(1, 9),
       step_tiles=st.integers(1, 4), supers=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_a_weight_from_row_slices_is_the_weight_regrouped_whole(format, tiles, step_tiles, supers, seed):
    """RowSlices (how a vocabulary projection reaches the kernels, so that its blocks are never
    held twice): both linears made from slices of any number of tiles, the last one short, hold
    the arrays the whole weight's regrouping holds, to the bit, and multiply alike; whole() is
    the weight itself."""
    from trillm.kernels import quant, quant_cpu

    blocks = random_gguf_blocks(format, 16 * tiles, 256 * supers, seed)
    whole = quant_cpu.from_gguf(format, blocks)
    sliced = quant.RowSlices(whole.format, whole.out_features, whole.in_features,
                             lambda rows: quant_cpu.from_gguf(format, blocks[rows]), 16 * step_tiles)
    for got, want in zip(quant._arrays(sliced.whole()), quant._arrays(whole)):
        assert (got is None and want is None) or torch.equal(got, want)
    x = torch.randn(3, whole.in_features, generator=torch.Generator().manual_seed(seed))
    kinds = [quant_cpu.Int8QuantizedLinear] + ([quant_cpu.QuantizedLinear] if quant_cpu.runs(whole) else [])
    for kind in kinds:
        by_slices, at_once = kind(sliced), kind(whole)
        assert by_slices.out_features == at_once.out_features == 16 * tiles
        arrays = [(name, array) for _, name, array in quant_cpu._tile_arrays(at_once)]
        assert [(name, array.shape) for _, name, array in quant_cpu._tile_arrays(by_slices)] == \
            [(name, array.shape) for name, array in arrays]
        for (_, _, got), (name, want) in zip(quant_cpu._tile_arrays(by_slices), arrays):
            assert torch.equal(got, want), (kind.__name__, name)
        assert torch.equal(by_slices(x), at_once(x))
    if tiles > 1:  # a rank's shard of rows, still by slices
        narrow = sliced.rows(slice(16, 16 * tiles))
        assert torch.equal(narrow.whole().quants, whole.quants[16:])


def test_activation_blocks_as_llama_cpp_makes_them():
    """quant.quantize_rows (the twin of the kernel's quantization): |v| <= 127, the block's
    largest |x| maps to +-127, an all-zero block stays zero, and e * v is x within e / 2."""
    from trillm.kernels import quant

    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1)) * torch.tensor([1.0, 100.0, 1e-3])[:, None]
    x[1, 32:64] = 0
    rows = quant.quantize_rows(x)
    blocks = x.reshape(3, 3, 32)
    v = rows.v.reshape(3, 3, 32).float()
    assert rows.v.dtype == torch.int8 and v.abs().max() <= 127
    assert torch.equal(v.abs().amax(-1)[rows.e != 0], torch.full_like(rows.e[rows.e != 0], 127.0))
    assert torch.equal(v[1, 1], torch.zeros(32)) and rows.e[1, 1] == 0 and rows.s[1, 1] == 0
    assert ((v * rows.e[..., None] - blocks).abs() <= rows.e[..., None] / 2 * (1 + 1e-6)).all()
    assert torch.allclose(rows.s, rows.e * v.sum(-1))


def test_activation_super_blocks_as_llama_cpp_makes_them_for_k_quants():
    """quant.quantize_rows by super-blocks (llama.cpp's Q8_K, for a weight with K-quant scales): one
    e for 256 inputs, the super-block's largest |x| maps to +-127 while a block of small values
    in it keeps small v, e * v is x within e / 2, and s is still per block of 32."""
    from trillm.kernels import quant

    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(2))
    x[0, :32] *= 1e-3  # a quiet block beside loud ones: by blocks it would get its own e
    rows = quant.quantize_rows(x, super_blocks=True)
    v = rows.v.reshape(2, 2, 256).float()
    assert rows.e.shape == (2, 2) and rows.s.shape == (2, 16)
    assert torch.equal(v.abs().amax(-1), torch.full((2, 2), 127.0))
    assert rows.v[0, :32].abs().max() <= 1
    assert ((v * rows.e[..., None] - x.reshape(2, 2, 256)).abs() <= rows.e[..., None] / 2 * (1 + 1e-6)).all()
    per_block = rows.e.repeat_interleave(8, dim=1)
    assert torch.allclose(rows.s, per_block * rows.v.reshape(2, 16, 32).float().sum(-1))


@pytest.mark.parametrize("format", ["q4_k", "q5_k", "q6_k", "q4_k_as_bytes"])
def test_integer_linear_sums_the_largest_k_quant_products_on_every_path(format):
    """Every quant at its largest (and at 0), every block factor at its largest magnitude (6-bit
    63 and mins 63; Q6_K's -128 and 127), against activations of +-127 and of mixed signs: the
    AVX2 path multiplies the factors in the integers (a super-block's sum held in int32, its pair
    sums in 16 bits), so these are the sums nearest to overflowing; every path makes the same
    floats, within the twin's tolerance."""
    from trillm.kernels import quant, quant_cpu

    base_format = format.removesuffix("_as_bytes")
    base = quant.from_gguf(base_format, random_gguf_blocks(base_format, 16, 512, seed=3))
    k = base.k_scales
    top = {"q4_k": 15, "q5_k": 31, "q6_k": 63}[base_format]
    factors = [torch.full_like(k.sc, 63)] if base_format != "q6_k" else [
        torch.full_like(k.sc, -128), torch.full_like(k.sc, 127)]
    signs = torch.tensor([1.0, -1.0]).repeat(256)
    x_rows = torch.stack([torch.ones(512), -torch.ones(512), signs])
    for value, sc in itertools.product((top, 0), factors):
        q = torch.full((16, 16, 32), value, dtype=torch.uint8)
        nibbles = (q[..., :16] & 15) | (q[..., 16:] & 15) << 4
        fifth_bits = torch.full((16, 16, 4), 255 if value else 0, dtype=torch.uint8)
        quants = {"q4_k": lambda: nibbles.reshape(16, -1),
                  "q5_k": lambda: torch.cat([nibbles, fifth_bits], -1).reshape(16, -1),
                  "q6_k": lambda: quant._pack_q6(q).reshape(16, -1)}[base_format]()
        scales = quant.KScales(sc, None if k.mn is None else torch.full_like(k.mn, 63), k.d, k.mk)
        weight = base._replace(quants=quants, k_scales=scales)
        weight = weight._replace(scales=scales.expanded()[0], mins=scales.expanded()[1])
        assert torch.equal(quant.block_quants(weight), q)
        if format.endswith("_as_bytes"):
            weight = quant.as_bytes(weight)
        want = quant.linear_int8(x_rows, weight)
        results = [quant_cpu.Int8QuantizedLinear(weight, isa)(x_rows) for isa in quant_cpu.isas()]
        for got in results:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
            assert torch.equal(got, results[0])


@settings(max_examples=25, deadline=None)
@given(format=st.sampled_from([*LAYOUTS, "q4_0", "q5_0"]), rows=st.integers(1, 70), tiles=st.integers(1, 5),
       blocks=st.integers(1, 6), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_integer_linear_matches_its_twin_on_every_path(format, rows, tiles, blocks, bias, seed):
    """Int8QuantizedLinear on each path this CPU runs (the widest, AVX2, plain C) against
    quant.linear_int8: any row count (whole and partial groups of the kernel's 8 rows, several
    row tiles past 64), any number of 16-output tiles and 32-input blocks, zero blocks of x;
    weights with mins of their own and with a fixed offset (Q4_0, Q5_0, Q8_0) alike."""
    from trillm.kernels import quant, quant_cpu

    weight = kernel_weight(format, 16 * tiles, 32 * blocks, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 32 * blocks, generator=g) * torch.rand(rows, 1, generator=g) * 10
    x[0, :32] = 0
    b = torch.randn(16 * tiles) if bias else None
    want = quant.linear_int8(x, weight, b)
    assert "generic" in quant_cpu.isas()
    for isa in quant_cpu.isas():
        torch.testing.assert_close(quant_cpu.Int8QuantizedLinear(weight, isa)(x, b), want, atol=1e-4, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(format=st.sampled_from(["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q5_1_as_bytes"]), rows=st.integers(1, 20),
       tiles=st.integers(1, 3), blocks=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_integer_linear_keeps_a_files_fp16_scales_in_fp16(format, rows, tiles, blocks, seed):
    """A file's block scales and mins are fp16: the integer kernel keeps them so, half the bytes
    of fp32 copies; Q4_0's and Q5_0's mins, -8 d and -16 d, it does not keep at all (it takes
    8 or 16 sum v off in the integers instead). On every path it gives what it gives on fp32
    copies of them, to the bit."""
    from trillm.kernels import quant, quant_cpu

    base = format.removesuffix("_as_bytes")
    weight = quant.from_gguf(base, random_gguf_blocks(base, 16 * tiles, 32 * blocks, seed))
    if format.endswith("_as_bytes"):
        weight = quant.as_bytes(weight)
    x = torch.randn(rows, 32 * blocks, generator=torch.Generator().manual_seed(seed)) * 3
    for isa in quant_cpu.isas():
        narrow, wide = quant_cpu.Int8QuantizedLinear(weight, isa), quant_cpu.Int8QuantizedLinear(weight, isa)
        (part,), (wide_part,) = narrow.parts, wide.parts
        implied = {"q4_0": -8.0, "q5_0": -16.0}.get(format, 0.0)
        assert part.d.dtype == torch.float16 and part.m_of_d == implied, isa
        if implied or weight.mins is None:
            assert part.m is None
        else:
            assert part.m.dtype == torch.float16
        wide_part.d = part.d.float()
        wide_part.m = None if part.m is None else part.m.float()
        assert torch.equal(narrow(x), wide(x)), isa


@pytest.mark.parametrize("format", ["q8_0", "q4_0"])
def test_a_fixed_offset_is_taken_off_in_the_integers(format):
    """Q8_0's bytes are u = q + 128 to the kernel, Q4_0's nibbles u = q + 8: it starts each
    block's integer dot from -128 (-8) sum v, so that it sums q v exactly. Where sum u v is
    large and sum q v small (q in -1..1, x all near one value), nothing large then cancels in
    fp32: on every path the result is sum d e sum(q v) over x's quantized blocks, as near as
    fp32 sums of those products come (taken off in fp32, the offset's product alone would be off
    by more than that bound)."""
    from trillm.kernels import quant, quant_cpu

    rows, blocks = 16, 8
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-1, 2, (rows, blocks, 32), generator=g)
    d = torch.ones(rows, blocks, 1, dtype=torch.float16).view(torch.uint8)
    if format == "q8_0":
        body = q.to(torch.int8).view(torch.uint8)
    else:  # byte j: input j in the low nibble, j + 16 in the high one
        u = (q + 8).to(torch.uint8)
        body = u[..., :16] | (u[..., 16:] << 4)
    weight = quant.from_gguf(format, torch.cat([d, body], -1).reshape(rows, -1))
    x = 1 + torch.rand(4, 32 * blocks, generator=g) / 10
    rows_q = quant.quantize_rows(x)
    exact = torch.einsum("mbk,nbk->mn", rows_q.v.double().reshape(4, blocks, 32) * rows_q.e.double()[..., None],
                         q.double())
    for isa in quant_cpu.isas():
        got = quant_cpu.Int8QuantizedLinear(weight, isa)(x).double()
        assert (got - exact).abs().max() < 1e-5, isa


def test_scales_and_mins_are_judged_on_the_whole_weight_even_by_slices():
    """A requantized weight's scales (max |w| / 127) are no fp16 values: the kernel keeps them in
    fp32. A vocabulary projection regrouped slice by slice is judged whole: a later slice's
    scales that are no fp16 values make every slice's fp32, a later slice's mins that are not
    -16 d keep every slice's mins; either way the arrays are the whole weight's, to the bit."""
    from trillm.kernels import quant, quant_cpu

    requantized = quant.requantize(torch.randn(32, 64, generator=torch.Generator().manual_seed(2)))
    assert quant_cpu.Int8QuantizedLinear(requantized).parts[0].d.dtype == torch.float32
    q5_0 = quant.from_gguf("q5_0", random_gguf_blocks("q5_0", 48, 64, seed=5))
    scales, mins = q5_0.scales.clone(), q5_0.mins.clone()
    scales[32:] *= 1 + 2**-20  # the last slice's: fp32 values between fp16 ones, its mins still -16 d
    mins[32:] *= 1 + 2**-20  # the last slice's: no longer -16 d, nor fp16 values
    for weight, dtypes in ((q5_0._replace(scales=scales, mins=scales * -16), (torch.float32, None)),
                           (q5_0._replace(mins=mins), (torch.float16, torch.float32))):
        sliced = quant.RowSlices(weight.format, 48, 64, weight.rows, 16)
        by_slices, at_once = quant_cpu.Int8QuantizedLinear(sliced), quant_cpu.Int8QuantizedLinear(weight)
        part = at_once.parts[0]
        assert (part.d.dtype, None if part.m is None else part.m.dtype) == dtypes
        assert part.m_of_d == (-16.0 if part.m is None else 0.0) == by_slices.parts[0].m_of_d
        got, want = list(quant_cpu._tile_arrays(by_slices)), list(quant_cpu._tile_arrays(at_once))
        assert [name for _, name, _ in got] == [name for _, name, _ in want]
        for (_, name, a), (_, _, b) in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), name
        x = torch.randn(3, 64)
        assert torch.equal(by_slices(x), at_once(x))
        torch.testing.assert_close(at_once(x), quant.linear_int8(x, weight), atol=1e-4, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(format=st.sampled_from(["q4_k", "q5_k", "q4_k_as_bytes"]), rows=st.integers(1, 70), tiles=st.integers(1, 5),
       supers=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_integer_linear_streams_k_quant_scales_as_the_file_keeps_them(format, rows, tiles, supers, seed):
    """A weight from Q4_K / Q5_K blocks runs on the file's 6-bit block factors and per-super-block
    d and dmin (3 bytes a block and row, not 8), x quantized by super-blocks: on every path within
    the twin's tolerance of it, where x by blocks would be a hundred times further off."""
    from trillm.kernels import quant, quant_cpu

    base = format.removesuffix("_as_bytes")
    weight = quant.from_gguf(base, random_gguf_blocks(base, 16 * tiles, 256 * supers, seed))
    if format.endswith("_as_bytes"):
        weight = quant.as_bytes(weight)
    assert weight.k_scales is not None
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 256 * supers, generator=g) * torch.rand(rows, 1, generator=g) * 10
    want = quant.linear_int8(x, weight)
    magnitude = x.abs() @ quant.dequantize(weight).abs().T
    for isa in quant_cpu.isas():
        on_k = quant_cpu.Int8QuantizedLinear(weight, isa)
        assert on_k.parts[0].sc is not None and on_k.parts[0].d is None
        got = on_k(x)
        # fp32 sums of K-quants' wide-ranging block terms: bounded by the terms' own magnitude
        assert ((got - want).abs() <= 1e-5 * magnitude + 1e-6).all(), isa


@pytest.mark.parametrize("format", ["q4_k", "q5_k", "q6_k", "q4_k_as_bytes", "q4_0", "q4_1", "q5_1", "q8_0"])
def test_integer_linear_on_amx_tiles_gives_avx512s_floats(format):
    """On AMX, a K-quant block's factor folded into the weights as two planes of bytes and the
    others' dots a block at a time give the AVX-512 path's integers and fp32 operations: its
    floats, to the bit, for row counts either side of a tile's 16 and a call's 64 (x's v padded
    to whole tiles), with zero blocks and rows of x; 8 rows or fewer go to the AVX-512 path."""
    from trillm.kernels import quant, quant_cpu

    if "amx" not in quant_cpu.isas():
        pytest.skip("the CPU has no AMX tiles, or Linux did not grant them")
    base = format.removesuffix("_as_bytes")
    cols = 512 if base.endswith("_k") else 96
    weight = quant.from_gguf(base, random_gguf_blocks(base, 48, cols, 7))
    if format.endswith("_as_bytes"):
        weight = quant.as_bytes(weight)
    amx, avx512 = quant_cpu.Int8QuantizedLinear(weight, "amx"), quant_cpu.Int8QuantizedLinear(weight, "avx512_vnni")
    for rows in (1, 8, 9, 16, 17, 64, 65, 130):
        g = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 10
        x[0, :32] = 0
        x[-1] = 0
        got = amx(x)
        assert torch.equal(got, avx512(x)), (format, rows)
        torch.testing.assert_close(got, quant.linear_int8(x, weight), atol=1e-3, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), tiles=st.integers(1, 5), supers=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_integer_linear_streams_q6_k_in_its_own_bits(rows, tiles, supers, seed):
    """A weight from Q6_K blocks runs in its own layout (6.6 bits a weight, two scales a block of
    32): on every path the same floats, to the bit, and within fp32 rounding of the float64
    twin; zero blocks of x included."""
    from trillm.kernels import quant, quant_cpu

    weight = quant.from_gguf("q6_k", random_gguf_blocks("q6_k", 16 * tiles, 256 * supers, seed))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 256 * supers, generator=g) * torch.rand(rows, 1, generator=g) * 10
    x[0, :32] = 0
    want = quant.linear_int8(x, weight)
    magnitude = x.abs() @ quant.dequantize(weight).abs().T
    results = []
    for isa in quant_cpu.isas():
        linear = quant_cpu.Int8QuantizedLinear(weight, isa)
        (part,) = linear.parts
        assert linear.bits == (6,) and part.u.numel() + part.h.numel() == weight.quants.numel()
        results.append(linear(x))
        assert ((results[-1] - want).abs() <= 1e-5 * magnitude + 1e-6).all(), isa
    assert all(torch.equal(r, results[0]) for r in results)


def test_integer_linear_sums_the_largest_six_bit_products_on_every_path():
    """Every quant 63 (and every one 0, the most negative q - 32) against activations of 127: the
    AVX2 path adds two groups' 16-bit pair sums (2 * 2 * 63 * 127 = 32004) before widening, the
    most that fits."""
    from trillm.kernels import quant, quant_cpu

    base = quant.from_gguf("q6_k", random_gguf_blocks("q6_k", 16, 256, seed=1))
    for value in (63, 0):
        q = torch.full((16, 8, 32), value, dtype=torch.uint8)
        weight = base._replace(quants=quant._pack_q6(q).reshape(16, -1))
        assert torch.equal(quant.block_quants(weight), q)
        for x in (torch.ones(3, 256), -torch.ones(3, 256)):
            want = quant.linear_int8(x, weight)
            for isa in quant_cpu.isas():
                torch.testing.assert_close(quant_cpu.Int8QuantizedLinear(weight, isa)(x), want, atol=1e-4, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 40), blocks=st.integers(1, 12), scale=st.sampled_from([1e-6, 1.0, 1e4]),
       seed=st.integers(0, 2**16))
def test_the_kernels_requantize_weights_as_the_twin_does(rows, blocks, scale, seed):
    """quant_cpu.requantize (the C row quantizer, which loading runs on a file's Q6_K tensors)
    makes quant.requantize's blocks to the bit, zero blocks included."""
    from trillm.kernels import quant, quant_cpu

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 32 * blocks, generator=g) * scale
    w[0, :32] = 0
    want, got = quant.requantize(w), quant_cpu.Int8QuantizedLinear.requantize(w)
    assert got.format == want.format == "q8_0" and got.mins is None
    assert torch.equal(got.quants, want.quants) and torch.equal(got.scales, want.scales)


def test_integer_linear_is_the_exact_product_of_its_quantized_operands():
    """With x already on its 8-bit grid (e * v exactly), the integer kernel has no rounding of its
    own to hide behind: it equals the exact path (fp32 activations) on the same x."""
    from trillm.kernels import quant, quant_cpu

    for format in LAYOUTS:
        weight = kernel_weight(format, 32, 128, seed=3)
        v = torch.randint(-127, 128, (5, 128), generator=torch.Generator().manual_seed(4)).float()
        v[:, ::32] = 127  # each block's largest |v|, so that e = 1 / 4 exactly
        x = v / 4
        assert torch.equal(quant.quantize_rows(x).v.float(), v)
        torch.testing.assert_close(quant_cpu.Int8QuantizedLinear(weight)(x), quant.linear(x, weight), atol=1e-4, rtol=1e-5)


def test_layouts_are_sliced_and_stacked_exactly():
    """Tensor parallelism cuts every layout by rows and by blocks of columns; a fused
    projection's shards in q5_1, q4_1 and q8_0 (a K-quant file's q, k and v) are stacked by
    quant.cat as q8_0 with mins. Each dequantizes to the same values, bit for bit, and shards
    that agree keep their layout."""
    from trillm.kernels import quant

    for format in LAYOUTS:
        weight = kernel_weight(format, 32, 128, 4)
        dense = quant.dequantize(weight)
        assert torch.equal(quant.dequantize(weight.columns(32, 96)), dense[:, 32:96]), format
        assert torch.equal(quant.dequantize(weight.rows(slice(16, 32))), dense[16:32]), format
    shards = [kernel_weight("q5_1", 32, 64, 1), kernel_weight("q4_1", 16, 64, 2), kernel_weight("q8_0", 16, 64, 3)]
    stacked = quant.cat(shards)
    assert stacked.format == "q8_0" and stacked.mins is not None
    assert torch.equal(quant.dequantize(stacked), torch.cat([quant.dequantize(w) for w in shards]))
    assert quant.cat(shards[:1] * 2).format == "q5_1"


@settings(max_examples=20, deadline=None)
@given(layouts=st.lists(st.sampled_from(["q4_k", "q5_k", "q6_k", "q8_0"]), min_size=2, max_size=4),
       rows=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_a_fused_projection_keeps_each_shards_layout_in_parts(layouts, rows, seed):
    """A K-quant file's q, k and v in different formats: for the integer kernel quant.cat keeps
    runs of one layout apart (QuantizedParts) instead of promoting every shard to 8 bits, and the
    kernel multiplies by all of them in one call, on every path, within fp32 rounding of the
    parts' twins; the fp32 kernel takes no parts."""
    from trillm.kernels import quant, quant_cpu

    shards = [quant_cpu.from_gguf(f, random_gguf_blocks(f, 16 * (i + 1), 512, seed + i)) for i, f in enumerate(layouts)]
    stacked = quant.cat(shards, parts=True)
    merged = [quant.LAYOUT_OF[f] for i, f in enumerate(layouts) if i == 0 or quant.LAYOUT_OF[layouts[i - 1]] != quant.LAYOUT_OF[f]]
    if len(merged) == 1:
        assert isinstance(stacked, quant.QuantizedWeight)
    else:
        assert [w.format for w in stacked.parts] == merged
    assert torch.equal(quant.dequantize(stacked), torch.cat([quant.dequantize(w) for w in shards]))
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(seed))
    want = torch.cat([quant.linear_int8(x, w) for w in shards], dim=-1)
    magnitude = x.abs() @ quant.dequantize(stacked).abs().T
    for isa in quant_cpu.isas():
        got = quant_cpu.Int8QuantizedLinear(stacked, isa)(x)
        assert ((got - want).abs() <= 1e-5 * magnitude + 1e-6).all(), isa
    assert not quant_cpu.QuantizedLinear.runs(stacked) or len(merged) == 1


@settings(max_examples=40, deadline=None)
@given(formats=st.lists(st.sampled_from(["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"]),
                        min_size=1, max_size=4),
       rows=st.lists(st.integers(1, 40), min_size=4, max_size=4), supers=st.integers(1, 3),
       step=st.integers(1, 48), permuted=st.booleans(), seed=st.integers(0, 2**16))
def test_blocks_regrouped_from_the_file_are_the_repacked_ones_to_the_bit(formats, rows, supers, step, permuted, seed):
    """A fused projection's shards regrouped straight from the file's bytes into the integer
    kernel's tiles (Int8Part.of_file, read `step` rows at a time, a shard's rows taken in
    another order where llama.cpp permuted them) hold every array Int8Part makes of their
    repacked, permuted and stacked QuantizedWeights, to the bit, in every format it reads so:
    shards whose rows split a tile of 16 included, the part's total filling whole tiles. Runs of
    two formats of one layout next to each other (Q4_0 then Q4_1) are not taken from the file:
    repacking stacks them into one part."""
    import contextlib

    from trillm.kernels import quant, quant_cpu

    sizes, start = rows[: len(formats)], 0
    for end in range(len(formats)):
        if end + 1 == len(formats) or formats[end + 1] != formats[end]:  # a run of one format ends
            sizes[end] += -sum(sizes[start : end + 1]) % 16  # and fills its tiles (int8_runs)
            start = end + 1
    g = torch.Generator().manual_seed(seed)
    raws = [random_gguf_blocks(f, n, 256 * supers, seed + i) for i, (f, n) in enumerate(zip(formats, sizes))]
    orders = [torch.randperm(n, generator=g) if permuted else None for n in sizes]

    def read(raw, rows):
        return contextlib.nullcontext(raw[rows].numpy())

    file_shards = quant.FileShards(tuple(
        quant.FileBlocks(f, n, 256 * supers, functools.partial(read, raw), order, None, step)
        for f, n, raw, order in zip(formats, sizes, raws, orders)))
    layouts = [quant.LAYOUT_OF[f] for f, _ in itertools.groupby(formats)]
    if any(a == b for a, b in zip(layouts, layouts[1:])):
        assert not quant_cpu.Int8QuantizedLinear.runs(file_shards)
        return
    assert quant_cpu.Int8QuantizedLinear.runs(file_shards)
    got = quant_cpu.Int8QuantizedLinear(file_shards)
    repacked = [quant_cpu.from_gguf(f, raw) for f, raw in zip(formats, raws)]
    repacked = [w if order is None else w.rows(order) for w, order in zip(repacked, orders)]
    want = quant_cpu.Int8QuantizedLinear(quant.cat(repacked, parts=True) if len(repacked) > 1 else repacked[0])
    assert got.bits == want.bits and (got.out_features, got.in_features) == (want.out_features, want.in_features)
    for mine, theirs in zip(got.parts, want.parts, strict=True):
        assert vars(mine).keys() == vars(theirs).keys()
        for name, value in vars(theirs).items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(getattr(mine, name), value), name
            else:
                assert getattr(mine, name) == value, name


def test_q6_k_is_sliced_and_stacked_in_its_own_layout_where_it_can_be():
    """q6_k's scales cover 16 inputs and its d a super-block of 256: a row-parallel shard on
    super-block boundaries, a row slice and a stack of q6_k shards stay q6_k, exactly; a shard
    that splits a super-block, and a fused projection mixing q6_k with Q4_K's q4_1 (a Q4_K_M
    file's q, k and v), become 8-bit blocks of its values, within half a step."""
    from trillm.kernels import quant

    weight = quant.from_gguf("q6_k", random_gguf_blocks("q6_k", 32, 768, seed=4))
    dense = quant.dequantize(weight)
    for got, want in ((weight.columns(256, 768), dense[:, 256:768]), (weight.rows(slice(16, 32)), dense[16:32]),
                      (quant.cat([weight, weight.rows(slice(0, 16))]), torch.cat([dense, dense[:16]]))):
        assert got.format == "q6_k" and got.k_scales is not None and torch.equal(quant.dequantize(got), want)
    split = weight.columns(32, 288)
    assert split.format == "q8_0"
    assert ((quant.dequantize(split) - dense[:, 32:288]).abs() <= split.scales.repeat_interleave(32, 1) * 0.5001).all()
    q4 = quant.from_gguf("q4_k", random_gguf_blocks("q4_k", 16, 768, seed=5))
    mixed = quant.cat([q4, weight])
    assert mixed.format == "q8_0" and torch.equal(quant.dequantize(mixed)[:16], quant.dequantize(q4))
    assert ((quant.dequantize(mixed)[16:] - dense).abs() <= mixed.scales[16:].repeat_interleave(32, 1) * 0.5001).all()


def test_integer_linear_sums_the_largest_five_bit_products_on_every_path():
    """Every quant 31 and every activation 127: the AVX2 path's 16-bit pair sums would overflow
    if a block's eight groups were added up before widening, as they are for nibbles."""
    from trillm.kernels import quant, quant_cpu

    base = quant.from_gguf("q5_1", random_gguf_blocks("q5_1", 16, 64, seed=1))
    q = torch.full((16, 2, 32), 31, dtype=torch.uint8)
    weight = quant.QuantizedWeight("q5_1", quant._pack_q5(q).reshape(16, -1), base.scales, base.mins)
    assert torch.equal(quant.block_quants(weight), q)
    x = torch.ones(3, 64)
    want = quant.linear_int8(x, weight)
    for isa in quant_cpu.isas():
        torch.testing.assert_close(quant_cpu.Int8QuantizedLinear(weight, isa)(x), want, atol=1e-4, rtol=1e-5)


def test_kernel_threads_share_the_tiles_without_changing_a_bit():
    """Two threads split the output tiles; each output's sum runs in the same order either way,
    so the result is the same to the bit, on both linears, called from two threads at once."""
    import concurrent.futures

    from trillm.kernels import pool_cpu, quant, quant_cpu

    weight = quant.from_gguf("q4_1", random_gguf_blocks("q4_1", 16 * 40, 32 * 6, seed=5))
    x = torch.randn(37, 32 * 6, generator=torch.Generator().manual_seed(6))
    linears = [quant_cpu.QuantizedLinear(weight), quant_cpu.Int8QuantizedLinear(weight)]
    previous = pool_cpu.set_threads(1)
    try:
        alone = [linear(x) for linear in linears]
        assert pool_cpu.set_threads(2) == 2
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for _ in range(20):
                together = list(pool.map(lambda linear: linear(x), linears))
                assert all(torch.equal(a, b) for a, b in zip(alone, together))
    finally:
        pool_cpu.set_threads(previous)


@pytest.mark.parametrize("format", [*LAYOUTS, "q6_k"])
def test_a_weight_regrouped_slice_by_slice_is_laid_out_as_at_once(format, monkeypatch):
    """Large weights are regrouped TILES_AT_ONCE tiles at a time (a 262k vocabulary's projection
    would otherwise be copied whole): with one tile a slice, every kernel array is the same."""
    from trillm.kernels import quant, quant_cpu

    if format == "q6_k":  # the integer kernel's alone
        weight = quant.from_gguf("q6_k", random_gguf_blocks("q6_k", 80, 256, seed=3))
        linears = [quant_cpu.Int8QuantizedLinear]
    else:
        weight = kernel_weight(format, 80, 64, seed=3)
        linears = [quant_cpu.Int8QuantizedLinear, quant_cpu.QuantizedLinear]
    whole = [linear(weight) for linear in linears]
    monkeypatch.setattr(quant_cpu, "TILES_AT_ONCE", 2)  # 5 tiles: slices of 2, 2 and 1
    sliced = [linear(weight) for linear in linears]
    for a, b in zip(whole, sliced):
        a, b = (getattr(linear, "parts", (linear,))[0] for linear in (a, b))
        for name, array in vars(a).items():
            if isinstance(array, torch.Tensor):
                assert torch.equal(array, getattr(b, name)), name


def test_quantized_linear_keeps_leading_dims_and_refuses_what_it_cannot_run():
    from trillm.kernels import quant, quant_cpu

    weight = quant.from_gguf("q8_0", random_gguf_blocks("q8_0", 32, 64))
    x = torch.randn(2, 3, 64)
    assert_close(quant_cpu.QuantizedLinear(weight)(x), quant.linear(x, weight), torch.float32)
    assert not quant_cpu.QuantizedLinear.runs(weight.rows(slice(0, 24)))  # 24 outputs: not whole tiles of 16
    with pytest.raises(AssertionError):
        quant_cpu.QuantizedLinear(weight)(x.to(torch.bfloat16))


# --- what the interpreter lets through and the compiler does not ------------------------------

TRITON_MODULES = [activation_triton, attention_triton, cache_triton, norm_triton, rotary_triton, lora_triton]


def compiler_accepts_global(value) -> bool:
    """Triton's code generator lets a kernel read a module global only if it is a module, another
    kernel, a `tl.constexpr` or something of triton.language; the interpreter runs the kernel as
    Python and reads any global, so a plain float constant passes here and fails on a GPU."""
    return (isinstance(value, (types.ModuleType, tl.constexpr, triton.runtime.KernelInterface))
            or getattr(value, "__module__", "").startswith("triton.language"))


@pytest.mark.parametrize("module", TRITON_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_kernels_read_only_globals_the_compiler_accepts(module):
    kernels = [value for value in vars(module).values() if isinstance(value, triton.runtime.KernelInterface)]
    assert kernels
    for kernel in kernels:
        for instruction in dis.get_instructions(kernel.fn):
            if instruction.opname == "LOAD_GLOBAL" and instruction.argval in vars(module):
                assert compiler_accepts_global(vars(module)[instruction.argval]), \
                    f"{kernel.fn.__name__} reads the global {instruction.argval}: make it a tl.constexpr"
