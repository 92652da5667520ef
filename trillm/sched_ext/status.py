"""A request's status and its finish reason, as enums, from the scheduler to the wire; the
scheduling policy that ranks requests; and the kinds of the allocator's KV-cache events.

`FinishReason`'s values are the strings OpenAI's wire format carries, made here and nowhere
else; being a `StrEnum`, a member is also that string (it compares, hashes, formats and
serializes as it), so the HTTP layer writes the member itself.
"""
import enum


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued: not admitted yet, or preempted
    RUNNING = 1  # holds blocks and is scheduled each step
    FINISHED = 2  # ended: finished or aborted; holds nothing


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an EOS or stop token id, a stop string, or a grammar's end
    LENGTH = "length"  # max_tokens, or the context or the KV pool is full
    ABORT = "abort"  # aborted: the client went away, /abort_request, a drain or a shutdown
    TOOL_CALLS = "tool_calls"  # the chat API's name for a stop whose text held tool calls


class SchedulingPolicy(enum.StrEnum):
    """How the scheduler ranks requests (`--scheduling-policy`, vLLM's names)."""

    FCFS = "fcfs"  # by arrival alone
    PRIORITY = "priority"  # by (priority, arrival): a lower `priority` runs first, and preempts


class PrefixHashAlgo(enum.StrEnum):
    """How the prefix cache keys its blocks (`--prefix-caching-hash-algo`, vLLM's names)."""

    BUILTIN = "builtin"  # Python's hash of (parent key, tokens): the fastest
    SHA256_CBOR = "sha256_cbor"  # vLLM's: SHA-256 of canonical CBOR, equal to vLLM's keys


class KVCacheEventKind(enum.IntEnum):
    """What the allocator's event log records (BlockAllocator.take_events; vLLM's event names)."""

    BLOCK_STORED = 1  # a full block entered the prefix cache: (kind, key, parent key or None, token ids, extra keys, lora id)
    BLOCK_REMOVED = 2  # a cached block was evicted: (kind, key)
    ALL_BLOCKS_CLEARED = 3  # the prefix cache was flushed: (kind,)
