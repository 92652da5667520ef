"""BlockAllocator: refcounts, the free stack, the prefix cache and its LRU."""
import json
from pathlib import Path

import pytest

from trillm.sched_ext import BlockAllocator, vllm_extra_keys
from trillm.sched_ext.status import KVCacheEventKind

BS = 4


def tokens(*blocks: int) -> list[int]:
    """A token list of full blocks, block k filled with the value blocks[k]."""
    return [value for value in blocks for _ in range(BS)]


def computed_table(alloc: BlockAllocator, token_ids: list[int], hashes: list | None = None) -> list[int]:
    """Allocate blocks for `token_ids` (all full) and offer them to the cache, as
    the scheduler does once they are computed."""
    table: list[int] = []
    alloc.allocate(table, len(token_ids) // BS)
    alloc.cache_full_blocks(table, token_ids, [] if hashes is None else hashes, 0, len(table))
    return table


def test_allocate_free_and_counts():
    alloc = BlockAllocator(8, BS)
    a, b = [], []
    assert alloc.can_allocate(8) and not alloc.can_allocate(9)
    alloc.allocate(a, 3)
    alloc.allocate(b, 2)
    assert len(set(a + b)) == 5
    assert (alloc.num_free_blocks, alloc.num_used_blocks, alloc.num_cached_blocks) == (3, 5, 0)
    alloc.check_invariants([a, b])
    alloc.free(a)
    assert a == [] and alloc.num_free_blocks == 6
    alloc.check_invariants([b])
    alloc.free(b)
    assert alloc.num_free_blocks == 8
    alloc.check_invariants([])


def test_allocate_beyond_room_is_refused():
    alloc = BlockAllocator(2, BS)
    with pytest.raises(AssertionError):
        alloc.allocate([], 3)


def test_check_invariants_catches_wrong_holders():
    alloc = BlockAllocator(4, BS)
    table: list[int] = []
    alloc.allocate(table, 2)
    with pytest.raises(AssertionError):
        alloc.check_invariants([])  # refcounts say 2 blocks are held
    with pytest.raises(AssertionError):
        alloc.check_invariants([table, table])  # one holder too many
    with pytest.raises(AssertionError):
        alloc.check_invariants([table + table[:1]])  # a block twice in one table


def test_prefix_hit_shares_blocks_by_refcount():
    alloc = BlockAllocator(8, BS)
    prompt = tokens(1, 2, 3) + [9]
    first = computed_table(alloc, prompt[:3 * BS])
    hits = alloc.match_prefix(prompt, [], 3)
    assert hits == first
    second: list[int] = []
    alloc.acquire_prefix(second, hits, 3)
    alloc.allocate(second, 1)
    alloc.check_invariants([first, second])  # the shared blocks have refcount 2
    assert (alloc.prefix_cache_queries, alloc.prefix_cache_hits) == (3, 3)
    alloc.free(first)
    assert alloc.num_cached_blocks == 0  # still held by `second`
    alloc.free(second)
    assert alloc.num_cached_blocks == 3 and alloc.num_free_blocks == 5
    alloc.check_invariants([])


def test_match_stops_at_first_difference_and_at_max_blocks():
    alloc = BlockAllocator(8, BS)
    table = computed_table(alloc, tokens(1, 2, 3))
    alloc.free(table[:])
    assert alloc.match_prefix(tokens(1, 2, 7), [], 3) == table[:2]
    assert alloc.match_prefix(tokens(5, 2, 3), [], 3) == []
    assert alloc.match_prefix(tokens(1, 2, 3), [], 1) == table[:1]
    assert alloc.prefix_cache_queries == 0  # matching alone counts nothing


def test_same_prefix_computed_twice_keeps_one_cached_copy():
    alloc = BlockAllocator(8, BS)
    a = computed_table(alloc, tokens(1, 2))
    b = computed_table(alloc, tokens(1, 2))
    assert b == a and alloc.num_free_blocks == 6, "b's copies gave way to the cached blocks"
    alloc.check_invariants([a, b])
    alloc.free(b[:])
    assert alloc.num_free_blocks == 6 and alloc.num_cached_blocks == 0  # a still holds them
    alloc.free(a[:])
    assert alloc.num_cached_blocks == 2
    alloc.check_invariants([])


def test_a_conversation_computed_beside_its_twin_stays_reachable():
    """Two requests share a first block and compute it in the same step; the second's own later
    blocks must hang off the cached copy, so its follow-up turn hits all of them."""
    alloc = BlockAllocator(16, BS)
    a: list[int] = []
    b: list[int] = []
    alloc.allocate(a, 2)
    alloc.allocate(b, 3)
    alloc.cache_full_blocks(a, tokens(1, 2), [], 0, 2)  # a's step: both blocks
    alloc.cache_full_blocks(b, tokens(1, 3, 4), [], 0, 2)  # b's chunk in the same step
    assert b[0] == a[0]
    alloc.cache_full_blocks(b, tokens(1, 3, 4), [], 2, 3)  # b's next step
    alloc.check_invariants([a, b])
    alloc.free(a[:])
    alloc.free(b[:])
    follow_up = tokens(1, 3, 4) + [9]
    assert alloc.match_prefix(follow_up, [], 3) == b
    assert alloc.match_prefix(tokens(1, 2) + [9], [], 2) == a


def test_colliding_key_with_other_tokens_is_a_miss():
    alloc = BlockAllocator(4, BS)
    key = 12345
    table = computed_table(alloc, tokens(1), [key])
    alloc.free(table[:])
    assert alloc.match_prefix(tokens(2), [key], 1) == []  # same key, other tokens
    assert alloc.match_prefix(tokens(1), [key], 1) == table


def test_colliding_key_with_other_parent_is_a_miss():
    alloc = BlockAllocator(8, BS)
    x = computed_table(alloc, tokens(1, 2), [10, 11])
    y = computed_table(alloc, tokens(3, 2), [20, 21])
    alloc.free(x[:])
    alloc.free(y[:])
    # Block 1 of y holds the tokens "2" after "3"; forged to the key of "2" after "1",
    # a query for "1, 2" must not take it: the KV of a block depends on its whole prefix.
    assert alloc.match_prefix(tokens(1, 2), [10, 21], 2) == x[:1]
    assert alloc.match_prefix(tokens(1, 2), [10, 11], 2) == x


def test_parent_evicted_and_reused_breaks_the_chain():
    alloc = BlockAllocator(2, BS)
    parent, child = computed_table(alloc, tokens(1, 2), [10, 11])
    alloc.free([parent, child])
    holder: list[int] = []
    alloc.acquire_prefix(holder, [child], 1)  # keep the child cached and held
    reused: list[int] = []
    alloc.allocate(reused, 1)  # the free stack is empty: evicts the parent
    assert reused == [parent]
    alloc.cache_full_blocks(reused, tokens(3), [30], 0, 1)
    # Same block id as the child's parent, other contents: a forged key for "2"
    # after "3" must not reach the child computed after "1".
    assert alloc.match_prefix(tokens(3, 2), [30, 11], 2) == [parent]
    alloc.check_invariants([holder, reused])


def test_eviction_only_when_free_stack_is_empty():
    alloc = BlockAllocator(4, BS)
    cached = computed_table(alloc, tokens(1))
    alloc.free(cached[:])
    table: list[int] = []
    alloc.allocate(table, 3)
    assert alloc.num_cached_blocks == 1 and cached[0] not in table
    alloc.allocate(table, 1)
    assert table[-1] == cached[0] and alloc.num_cached_blocks == 0
    assert alloc.match_prefix(tokens(1), [], 1) == []
    alloc.check_invariants([table])


def test_lru_evicts_tail_blocks_first_and_oldest_tables_first():
    alloc = BlockAllocator(5, BS)
    old = computed_table(alloc, tokens(1, 2, 3))
    new = computed_table(alloc, tokens(7, 8))
    alloc.free(old[:])  # LRU: old[2], old[1], old[0]
    alloc.free(new[:])  # then new[1], new[0]
    order = []
    for _ in range(5):
        table: list[int] = []
        alloc.allocate(table, 1)
        order += table
    assert order == old[::-1] + new[::-1]


def test_a_hit_refreshes_recency():
    alloc = BlockAllocator(2, BS)
    a = computed_table(alloc, tokens(1))
    b = computed_table(alloc, tokens(2))
    alloc.free(a[:])
    alloc.free(b[:])  # LRU: a, b
    holder: list[int] = []
    alloc.acquire_prefix(holder, alloc.match_prefix(tokens(1), [], 1), 1)
    alloc.free(holder)  # LRU: b, a
    table: list[int] = []
    alloc.allocate(table, 1)
    assert table == b
    assert alloc.match_prefix(tokens(1), [], 1) == a


def test_can_allocate_counts_hits_at_refcount_zero_as_taken():
    alloc = BlockAllocator(3, BS)
    cached = computed_table(alloc, tokens(1, 2, 3))
    alloc.free(cached[:])
    hits = alloc.match_prefix(tokens(1, 2, 3), [], 2)
    assert alloc.can_allocate(1, hits) and not alloc.can_allocate(2, hits)
    assert alloc.can_allocate(3)


def test_reset_prefix_cache_refused_while_in_use():
    alloc = BlockAllocator(4, BS)
    table = computed_table(alloc, tokens(1, 2))
    held: list[int] = []
    alloc.allocate(held, 1)
    alloc.free(table[:])
    assert alloc.reset_prefix_cache() is False
    assert alloc.num_cached_blocks == 2 and alloc.match_prefix(tokens(1, 2), [], 2) == table
    alloc.free(held)
    assert alloc.reset_prefix_cache() is True
    assert alloc.num_free_blocks == 4 and alloc.num_cached_blocks == 0
    assert alloc.match_prefix(tokens(1, 2), [], 2) == []
    alloc.check_invariants([])


def test_prefix_caching_disabled():
    alloc = BlockAllocator(4, BS, enable_prefix_caching=False)
    table = computed_table(alloc, tokens(1, 2))
    alloc.free(table[:])
    assert alloc.num_free_blocks == 4 and alloc.num_cached_blocks == 0
    assert alloc.match_prefix(tokens(1, 2), [], 2) == []
    alloc.check_invariants([])


def test_hash_chain_memo_is_extended_not_recomputed():
    alloc = BlockAllocator(8, BS)
    hashes: list = []
    alloc.match_prefix(tokens(1, 2, 3), hashes, 2)
    assert len(hashes) == 2 and len(set(hashes)) == 2
    first_two = list(hashes)
    alloc.match_prefix(tokens(1, 2, 3), hashes, 3)
    assert hashes[:2] == first_two and len(hashes) == 3
    other: list = []
    alloc.match_prefix(tokens(9, 2, 3), other, 3)
    assert all(a != b for a, b in zip(hashes, other))  # a chain: one change moves every later key


def test_a_cache_salt_isolates_cached_blocks_even_through_a_hash_collision():
    alloc = BlockAllocator(16, BS)
    prompt = tokens(1, 2, 3)
    salted_hashes: list = []
    salted: list[int] = []
    alloc.allocate(salted, 3)
    alloc.cache_full_blocks(salted, prompt, salted_hashes, 0, 3, "tenant-a")
    assert alloc.match_prefix(prompt, [], 3) == []  # unsalted: no hit
    assert alloc.match_prefix(prompt, [], 3, "tenant-b") == []
    assert alloc.match_prefix(prompt, [], 3, "tenant-a") == salted
    # tenant b's lookup forced onto tenant a's keys (a hash collision): the identities differ.
    assert alloc.match_prefix(prompt, list(salted_hashes), 3, "tenant-b") == []
    unsalted = computed_table(alloc, prompt)
    assert not set(unsalted) & set(salted) and alloc.match_prefix(prompt, [], 3) == unsalted
    alloc.check_invariants([salted, unsalted])


def test_sha256_cbor_keys_equal_vllms(monkeypatch):
    """vLLM's own hash_block_tokens with sha256_cbor made these chains (tests/data); trillm's keys
    for the same tokens, cache salt and adapter are the same bytes, so a router hashing as vLLM
    does finds trillm's blocks, and an adapter's blocks' events carry vLLM's extra keys."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    vectors = json.loads((Path(__file__).parent / "data" / "vllm_sha256_cbor_vectors.json").read_text())
    adapters = 0
    for case in vectors["cases"]:
        alloc = BlockAllocator(8, case["block_size"], hash_algo="sha256_cbor", record_events=True)
        hashes: list = []
        blocks = len(case["token_ids"]) // case["block_size"]
        salt = case["cache_salt"] or ""
        extra = vllm_extra_keys(case["lora_name"], case["lora_path"], salt) if "lora_name" in case else None
        adapters += extra is not None
        assert alloc.match_prefix(case["token_ids"], hashes, blocks, salt, extra) == []
        assert [h.hex() for h in hashes] == case["block_hashes"], case["name"]
        if extra is not None:  # stored, its events carry vLLM's untagged extra keys
            table: list = []
            alloc.allocate(table, blocks)
            alloc.cache_full_blocks(table, case["token_ids"], hashes, 0, blocks, salt, 3, extra)
            stored = [event for event in alloc.take_events() if event[0] == KVCacheEventKind.BLOCK_STORED]
            assert [list(event[4]) for event in stored] == case["event_extra_keys"], case["name"]
    assert adapters == 2
    # and the chain's root is vLLM's NONE_HASH, which PYTHONHASHSEED would move, as in vLLM
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    alloc = BlockAllocator(8, 16, hash_algo="sha256_cbor")
    hashes = []
    alloc.match_prefix(vectors["cases"][0]["token_ids"], hashes, 1)
    assert hashes[0].hex() != vectors["cases"][0]["block_hashes"][0]


def test_an_unknown_hash_algo_is_refused():
    with pytest.raises(ValueError, match="builtin, sha256_cbor"):
        BlockAllocator(8, BS, hash_algo="md5")
