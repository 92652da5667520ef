"""The paged KV cache's block allocator, with prefix caching.

A fixed pool of `num_blocks` blocks of `block_size` token slots. Every block is in
exactly one of three places:

- free: on the free stack, holding nothing worth keeping;
- used: held by one or more block tables (its refcount says how many);
- cached: refcount 0 but still holding the KV of a full block of tokens that a
  later request with the same prefix can reuse. Cached blocks sit in an LRU list
  and are evicted only when the free stack is empty.

Prefix caching keys a full block by a hash chain, `hash((parent_key, tokens))`,
so that one key stands for the whole prefix up to the end of that block. A key is
only a hint: a hash can collide, and serving the KV of another prefix would
silently corrupt a generation. So a hit is accepted only if the block's stored
token tuple equals the query's, and its stored parent is the very block the
previous hit returned, in the same generation (a block's generation moves on each
time it is handed out afresh, so a parent that was evicted and reused for other
tokens no longer matches). By induction the whole prefix is then exactly equal.

A request's cache salt (tenants' isolation, vLLM's `cache_salt`) enters the chain at its root
and the identity of its first block, so requests with different salts never share a block,
not even through a hash collision; "" is no salt.

The key is Python's hash by default (`hash_algo="builtin"`), or vLLM's `sha256_cbor`: SHA-256
over the canonical CBOR of (parent key, the block's token ids, extra keys), the first block's
parent vLLM's NONE_HASH (SHA-256 over CBOR of PYTHONHASHSEED, else of "vllm-none-hash"). The
extra keys are the request's own (`extra_keys`: the first block's and the later blocks', as
vLLM makes them: ("lora", name, path) on every block of an adapter's request, then
("cache_salt", salt) on the first), or, without them, (("cache_salt", salt),) on a salted first
block. Those keys equal vLLM's for the same tokens, salt and adapter, so a router that hashes
prompts as vLLM does finds trillm's blocks by the KV-cache events. The salt still makes the
blocks' identity (below): it is what isolates them, whatever the hash.

With `record_events`, the allocator logs what enters and leaves the prefix cache (a full block
cached, a cached block evicted, a flush) for `take_events`, which the engine publishes as vLLM's
KV-cache events (trillm/engine/kv_events.py): replayed in order, the log rebuilds the set of
cached keys exactly.

The per-block state lives in typed arrays and the LRU is linked through them, so
every operation costs O(blocks touched), never O(num_blocks). The same file runs
as plain Python (Cython's pure-Python mode), which is how the benchmark measures
what compiling buys; allocator.pxd holds the C-level declarations.
"""
import array
import hashlib
import os

import cython

from trillm.sched_ext.status import KVCacheEventKind, PrefixHashAlgo

COMPILED = cython.compiled
_ROOT_KEY = 0  # the parent key of a prompt's first block
# builtin keys as unsigned 64-bit integers: routers that read the KV-cache events (vllm-router's
# kv_aware) take a block hash as bytes or an unsigned integer, and refuse a batch with a negative one
_KEY_MASK = 0xFFFFFFFFFFFFFFFF
HASH_ALGOS = tuple(PrefixHashAlgo)


def vllm_extra_keys(lora_name: str, lora_path: str, salt: str) -> tuple:
    """An adapter's request's sha256_cbor extra keys as vLLM makes them, (the first block's,
    the others'): ("lora", name, path) on every block, ("cache_salt", salt) after it on the first."""
    adapter = (("lora", lora_name, lora_path),)
    return adapter + ((("cache_salt", salt),) if salt else ()), adapter


def sha256_cbor(value) -> bytes:
    """vLLM's sha256_cbor: SHA-256 of `value`'s canonical CBOR encoding."""
    import cbor2  # only this hash needs it

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def none_hash() -> bytes:
    """vLLM's NONE_HASH for a cryptographic hash: the parent key of every first block."""
    return sha256_cbor(os.environ.get("PYTHONHASHSEED", "vllm-none-hash"))


def _int_array(size: cython.int, value: cython.int) -> array.array:
    return array.array("i", [value]) * size


def _long_array(size: cython.int) -> array.array:
    return array.array("q", [0]) * size


@cython.cclass
class BlockAllocator:
    """Hands out KV blocks to block tables; shares and caches full blocks by prefix."""

    def __init__(self, num_blocks: cython.int, block_size: cython.int = 16, enable_prefix_caching: cython.bint = True,
                 record_events: cython.bint = False, hash_algo: str = "builtin"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        if hash_algo not in HASH_ALGOS:
            raise ValueError(f"the prefix-caching hash is one of {', '.join(HASH_ALGOS)}, got {hash_algo!r}")
        self._root_key = none_hash() if hash_algo == "sha256_cbor" else _ROOT_KEY
        self._sha256_cbor = hash_algo == "sha256_cbor"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_free_blocks = num_blocks
        self.num_cached_blocks = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._ref = _int_array(num_blocks, 0)
        # Popped from the end: block 0 is handed out first.
        self._free = array.array("i", range(num_blocks - 1, -1, -1))
        self._lru_prev = _int_array(num_blocks, -1)
        self._lru_next = _int_array(num_blocks, -1)
        self._lru_head = -1
        self._lru_tail = -1
        self._gen = _long_array(num_blocks)
        self._parent = _int_array(num_blocks, -1)
        self._parent_gen = _long_array(num_blocks)
        self._keys = [None] * num_blocks
        self._tokens = [None] * num_blocks
        self._cache = {}
        self._events = [] if record_events else None

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks - self.num_cached_blocks

    @cython.ccall
    def can_allocate(self, num_new: cython.int, prefix: list = None) -> cython.bint:
        """Whether `num_new` fresh blocks fit once `prefix` (cache hits) is taken.

        Taking a hit at refcount 0 pulls it out of the LRU, so it no longer
        counts as evictable room.
        """
        available: cython.int = self.num_free_blocks + self.num_cached_blocks
        block: cython.int
        if prefix is not None:
            for block in prefix:
                if self._ref[block] == 0:
                    available -= 1
        return num_new <= available

    @cython.ccall
    def allocate(self, table: list, num_new: cython.int):
        """Append `num_new` fresh blocks to `table`, evicting LRU cached blocks
        only once the free stack is empty."""
        assert num_new <= self.num_free_blocks + self.num_cached_blocks, "allocate() beyond can_allocate()"
        block: cython.int
        i: cython.int
        for i in range(num_new):
            if self.num_free_blocks > 0:
                self.num_free_blocks -= 1
                block = self._free[self.num_free_blocks]
            else:
                block = self._lru_head
                self._lru_remove(block)
                self.num_cached_blocks -= 1
                if self._events is not None:
                    self._events.append((KVCacheEventKind.BLOCK_REMOVED, self._keys[block]))
                self._uncache(block)
            self._gen[block] += 1
            self._ref[block] = 1
            table.append(block)

    @cython.ccall
    def free(self, table: list):
        """Release every block of `table` and empty it.

        Tail first: the end of a sequence is the least likely part to be shared
        again, so its cached blocks land nearest the LRU head and go first.
        """
        block: cython.int
        i: cython.int = len(table) - 1
        while i >= 0:
            block = table[i]
            i -= 1
            self._ref[block] -= 1
            assert self._ref[block] >= 0, "block freed more often than held"
            if self._ref[block] == 0:
                if self._tokens[block] is None:
                    self._free[self.num_free_blocks] = block
                    self.num_free_blocks += 1
                else:
                    self._lru_append(block)
                    self.num_cached_blocks += 1
        del table[:]

    @cython.ccall
    def match_prefix(self, token_ids: list, block_hashes: list, max_blocks: cython.int, salt: str = "",
                     extra_keys: tuple = None) -> list:
        """The longest run of cached blocks holding exactly the first full blocks
        of `token_ids` (at most `max_blocks`) under `salt` (and, for sha256_cbor keys, the
        request's `extra_keys`: module docstring). Changes nothing but `block_hashes`, the
        per-request memo of the hash chain, which it extends as needed."""
        hits: list = []
        if not self.enable_prefix_caching or max_blocks <= 0:
            return hits
        self._extend_hashes(token_ids, block_hashes, max_blocks, salt, extra_keys)
        parent: cython.int = -1
        block: cython.int
        i: cython.int
        for i in range(max_blocks):
            block = self._cache.get(block_hashes[i], -1)
            if block < 0 or not self._holds(block, parent, self._block_tokens(token_ids, i, salt)):
                break
            hits.append(block)
            parent = block
        return hits

    @cython.ccall
    def acquire_prefix(self, table: list, prefix: list, num_queried: cython.int):
        """Share the hit blocks `prefix` into `table`, and count the query:
        `num_queried` blocks looked up, `len(prefix)` found."""
        assert len(prefix) <= num_queried, "more hits than blocks looked up"
        block: cython.int
        for block in prefix:
            if self._ref[block] == 0:
                self._lru_remove(block)
                self.num_cached_blocks -= 1
            self._ref[block] += 1
            table.append(block)
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += len(prefix)

    @cython.ccall
    def cache_full_blocks(self, table: list, token_ids: list, block_hashes: list, start: cython.int, end: cython.int,
                          salt: str = "", lora_id: cython.int = 0, extra_keys: tuple = None):
        """Offer blocks `table[start:end]`, now full and computed, to the prefix cache (under
        the request's `salt` and `extra_keys`, as `match_prefix`; `lora_id`, its adapter's, goes
        only into the event log).

        A block whose prefix is already cached in another block (the same prefix
        computed twice at once: a burst of requests sharing a system prompt) is
        swapped in the table for that cached twin, and goes back to the free
        stack. So a table's full blocks are all cached ones, in one chain, and
        the blocks this table caches later hang off the cached chain, where
        `match_prefix` finds them (a private copy as their parent would make
        every later block of the conversation unreachable). Only a true hash
        collision, whose twin holds other tokens, leaves a block private.
        """
        if not self.enable_prefix_caching:
            return
        self._extend_hashes(token_ids, block_hashes, end, salt, extra_keys)
        block: cython.int
        twin: cython.int
        parent: cython.int
        i: cython.int
        for i in range(start, end):
            block = table[i]
            if self._tokens[block] is not None:
                continue  # a prefix hit: cached already
            key = block_hashes[i]
            parent = table[i - 1] if i > 0 else -1
            tokens = self._block_tokens(token_ids, i, salt)
            twin = self._cache.get(key, -1)
            if twin < 0:
                self._cache[key] = block
                self._keys[block] = key
                self._tokens[block] = tokens
                self._parent[block] = parent
                self._parent_gen[block] = self._gen[parent] if parent >= 0 else 0
                if self._events is not None:
                    self._events.append((KVCacheEventKind.BLOCK_STORED, key, block_hashes[i - 1] if i > 0 else None,
                                         tokens[1] if i == 0 and salt else tokens,
                                         self._event_keys(i, salt, extra_keys), lora_id))
            elif self._holds(twin, parent, tokens):
                assert self._ref[block] == 1, "a block not yet cached is held by its one table"
                if self._ref[twin] == 0:
                    self._lru_remove(twin)
                    self.num_cached_blocks -= 1
                self._ref[twin] += 1
                table[i] = twin
                self._ref[block] = 0
                self._free[self.num_free_blocks] = block
                self.num_free_blocks += 1

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block to the free stack. Refused (False) while any
        block is in use: a held block may be shared through the cache."""
        if self.num_used_blocks > 0:
            return False
        block: cython.int = self._lru_head
        while block >= 0:
            self._uncache(block)
            self._free[self.num_free_blocks] = block
            self.num_free_blocks += 1
            block = self._lru_next[block]
        self._lru_head = -1
        self._lru_tail = -1
        self.num_cached_blocks = 0
        if self._events is not None:
            self._events.append((KVCacheEventKind.ALL_BLOCKS_CLEARED,))
        return True

    def take_events(self) -> list:
        """The events logged since the last call, oldest first (tuples; KVCacheEventKind says
        their fields), and an empty log; [] when events are not recorded."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    @property
    def cached_keys(self) -> set:
        """The hash-chain keys of every cached block (held or not): what the event log replays to."""
        return set(self._cache)

    def check_invariants(self, holders: list):
        """Assert the allocator's invariants, given the block tables of all live
        requests: every block in exactly one place, free + used + cached = total,
        refcounts = number of holding tables, cache index and LRU consistent.
        O(num_blocks), on typed arrays: the state machine tests call it after every step."""
        block: cython.int
        i: cython.int
        n: cython.int = self.num_blocks
        held: cython.int[::1] = _int_array(n, 0)
        place: cython.int[::1] = _int_array(n, 0)
        FREE: cython.int = 1
        CACHED: cython.int = 2
        USED: cython.int = 3
        for table in holders:
            assert len(set(table)) == len(table), f"a block appears twice in one table: {table}"
            for block in table:
                assert 0 <= block < n, f"block id {block} out of range"
                held[block] += 1
        for i in range(self.num_free_blocks):
            block = self._free[i]
            assert place[block] == 0, f"block {block} twice on the free stack"
            assert self._tokens[block] is None, f"free block {block} is still cached"
            place[block] = FREE
        walked: cython.int = 0
        prev: cython.int = -1
        block = self._lru_head
        while block >= 0:
            assert place[block] == 0, f"block {block} both free and cached, or in a loop"
            assert self._tokens[block] is not None, f"LRU block {block} holds no cached tokens"
            assert self._lru_prev[block] == prev, f"LRU back link of block {block} is broken"
            place[block] = CACHED
            walked += 1
            prev, block = block, self._lru_next[block]
        assert prev == self._lru_tail, "LRU tail is not the last block"
        assert walked == self.num_cached_blocks, f"LRU holds {walked} blocks, count says {self.num_cached_blocks}"
        used: cython.int = 0
        tokened: cython.int = 0
        for block in range(n):
            assert self._ref[block] == held[block], (
                f"block {block}: refcount {self._ref[block]}, held by {held[block]} tables")
            if held[block]:
                assert place[block] == 0, f"block {block} is held and also free or cached"
                place[block] = USED
                used += 1
            assert place[block] != 0, f"block {block} is nowhere"
            if self._tokens[block] is not None:
                tokened += 1
        assert used == self.num_used_blocks
        for key, block in self._cache.items():
            assert self._keys[block] == key and self._tokens[block] is not None, f"cache index broken at {block}"
        assert tokened == len(self._cache), "a cached block is missing from the index"
        assert 0 <= self.prefix_cache_hits <= self.prefix_cache_queries

    @cython.cfunc
    def _holds(self, block: cython.int, parent: cython.int, tokens: tuple) -> cython.bint:
        """Whether cached `block` holds exactly `tokens` after the prefix that ends with block
        `parent` (-1: none): its parent is that very block, in the same generation."""
        if self._parent[block] != parent:
            return False
        if parent >= 0 and self._parent_gen[block] != self._gen[parent]:
            return False
        return self._tokens[block] == tokens

    @cython.cfunc
    def _block_tokens(self, token_ids: list, index: cython.int, salt: str) -> tuple:
        """A block's identity: its tokens; a salted first block's, (salt, tokens), which no
        unsalted or otherwise salted block equals."""
        tokens = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
        return (salt, tokens) if index == 0 and salt else tokens

    @cython.cfunc
    def _extra_keys(self, index: cython.int, salt: str, extra_keys: tuple) -> tuple:
        """A block's sha256_cbor extra keys (vLLM's, tagged), or None."""
        if extra_keys is not None:
            return extra_keys[0 if index == 0 else 1]
        return (("cache_salt", salt),) if index == 0 and salt else None

    @cython.cfunc
    def _event_keys(self, index: cython.int, salt: str, extra_keys: tuple):
        """A stored block's extra keys as its event carries them: vLLM's untagged ones (an
        adapter's name, a salt) with sha256_cbor keys, else the salt of a salted first block."""
        if not self._sha256_cbor:
            return (salt,) if index == 0 and salt else None
        tagged = self._extra_keys(index, salt, extra_keys)
        return None if tagged is None else tuple(key[1] for key in tagged)

    @cython.cfunc
    def _extend_hashes(self, token_ids: list, block_hashes: list, num_full: cython.int, salt: str,
                       extra_keys: tuple):
        """Extend the hash chain memo to the first `num_full` full blocks."""
        assert num_full * self.block_size <= len(token_ids), "hash of a block that is not full"
        i: cython.int = len(block_hashes)
        key = block_hashes[i - 1] if i > 0 else self._root_key
        while i < num_full:
            if self._sha256_cbor:
                key = sha256_cbor((key, self._block_tokens(token_ids, i, ""), self._extra_keys(i, salt, extra_keys)))
            else:
                key = hash((key, self._block_tokens(token_ids, i, salt))) & _KEY_MASK
            block_hashes.append(key)
            i += 1

    @cython.cfunc
    def _uncache(self, block: cython.int):
        del self._cache[self._keys[block]]
        self._keys[block] = None
        self._tokens[block] = None

    @cython.cfunc
    def _lru_append(self, block: cython.int):
        self._lru_prev[block] = self._lru_tail
        self._lru_next[block] = -1
        if self._lru_tail >= 0:
            self._lru_next[self._lru_tail] = block
        else:
            self._lru_head = block
        self._lru_tail = block

    @cython.cfunc
    def _lru_remove(self, block: cython.int):
        prev: cython.int = self._lru_prev[block]
        nxt: cython.int = self._lru_next[block]
        if prev >= 0:
            self._lru_next[prev] = nxt
        else:
            self._lru_head = nxt
        if nxt >= 0:
            self._lru_prev[nxt] = prev
        else:
            self._lru_tail = prev
