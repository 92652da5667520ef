# The C-level layout of BlockAllocator, so that scheduler.pyx calls it without
# going through Python attribute lookups. allocator.pyx holds the code and the
# reasons; keep the two in step.

cdef class BlockAllocator:
    cdef readonly int num_blocks
    cdef readonly int block_size
    cdef readonly bint enable_prefix_caching
    cdef readonly int num_free_blocks
    cdef readonly int num_cached_blocks
    cdef readonly long long prefix_cache_queries
    cdef readonly long long prefix_cache_hits

    cdef int[::1] _ref          # per block: number of block tables holding it
    cdef int[::1] _free         # stack of free block ids, _free[:num_free_blocks]
    cdef int[::1] _lru_prev     # doubly linked LRU of cached blocks at refcount 0
    cdef int[::1] _lru_next
    cdef int _lru_head          # least recently used: evicted first
    cdef int _lru_tail
    cdef long long[::1] _gen    # bumped each time a block is handed out afresh
    cdef int[::1] _parent       # cached block: the block before it when it was computed
    cdef long long[::1] _parent_gen
    cdef list _keys             # cached block: its hash-chain key, else None
    cdef list _tokens           # cached block: its token tuple, else None
    cdef dict _cache            # key -> block id
    cdef list _events           # the event log (KVCacheEventKind tuples), or None when not recorded
    cdef object _root_key       # the parent key of a first block (0, or vLLM's NONE_HASH)
    cdef bint _sha256_cbor      # keys by vLLM's sha256_cbor, not Python's hash

    cpdef bint can_allocate(self, int num_new, list prefix=*)
    cpdef allocate(self, list table, int num_new)
    cpdef free(self, list table)
    cpdef list match_prefix(self, list token_ids, list block_hashes, int max_blocks, str salt=*, tuple extra_keys=*)
    cpdef acquire_prefix(self, list table, list prefix, int num_queried)
    cpdef cache_full_blocks(self, list table, list token_ids, list block_hashes, int start, int end, str salt=*,
                            int lora_id=*, tuple extra_keys=*)
    cdef bint _holds(self, int block, int parent, tuple tokens)
    cdef tuple _block_tokens(self, list token_ids, int index, str salt)
    cdef tuple _extra_keys(self, int index, str salt, tuple extra_keys)
    cdef _event_keys(self, int index, str salt, tuple extra_keys)
    cdef _extend_hashes(self, list token_ids, list block_hashes, int num_full, str salt, tuple extra_keys)
    cdef _uncache(self, int block)
    cdef _lru_append(self, int block)
    cdef _lru_remove(self, int block)
