"""vLLM's KV-cache event classes as a subscriber decodes them (vllm/distributed/kv_events.py of
vLLM 0.32: field names, order, defaults and msgspec options), written here so that the tests
decode trillm's events the way llm-d or Dynamo would, without vLLM installed; and a replica of
the cache those events describe."""
from __future__ import annotations

from typing import Any

import msgspec

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class CacheReplica:
    """The set of cached block hashes a subscriber rebuilds from the batches alone; it also
    checks the log is consistent (a block stored once until removed, removed only if stored,
    a stored block's parent cached, its tokens a full block, every hash bytes or an unsigned
    64-bit integer, as vllm-router's kv_aware subscriber requires)."""

    def __init__(self):
        self.hashes: set[ExternalBlockHash] = set()
        self.batches = 0

    def apply(self, payload: bytes) -> KVEventBatch:
        batch = DECODER.decode(payload)
        self.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == event.block_size * len(event.block_hashes)
                assert event.parent_block_hash is None or event.parent_block_hash in self.hashes, "orphan block"
                for block_hash in event.block_hashes:
                    assert isinstance(block_hash, bytes) or 0 <= block_hash < 2 ** 64, block_hash
                    assert block_hash not in self.hashes, "stored twice"
                    self.hashes.add(block_hash)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    assert block_hash in self.hashes, "removed what was never stored"
                    self.hashes.remove(block_hash)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.hashes.clear()
        return batch
