"""What the engine reports about itself: frozen records, read by /server_info, /load and the
Prometheus collector. Each field's docstring says what it counts."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """EngineCore's state between two steps."""

    num_running: int
    """Requests in the running batch: admitted, holding KV blocks, scheduled every step."""
    num_waiting: int
    """Requests in the core's waiting queue: not admitted yet, or preempted."""
    num_kv_blocks: int
    """The KV cache's size, in blocks."""
    num_free_blocks: int
    """Blocks on the free stack: holding nothing worth keeping."""
    num_used_blocks: int
    """Blocks held by live requests' block tables."""
    num_cached_blocks: int
    """Blocks nobody holds that keep a full block's KV for the prefix cache (evicted LRU)."""
    kv_cache_usage: float
    """num_used_blocks / num_kv_blocks: what live requests hold, 0 to 1."""
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache at admission, since start."""
    prefix_cache_hits: int
    """Of those, tokens found (their KV was not computed again), since start."""
    num_preemptions: int
    """Requests preempted by recompute when blocks ran out, since start."""
    running_lora_adapters: tuple[str, ...]
    """LoRA adapters of running requests (vLLM's lora_requests_info), by name."""
    waiting_lora_adapters: tuple[str, ...]
    """LoRA adapters of waiting requests, by name."""
    num_lora_adapters: int
    """LoRA adapters requests may name (loaded, whether their weights are in host memory or not)."""
    lora_memory_bytes: int
    """Host memory held by adapters' weights (the model's adapter slots not counted)."""
    spec_decode_num_drafts: int
    """Speculative decoding: decodes that verified drafts, since start."""
    spec_decode_num_draft_tokens: int
    """Draft tokens verified, since start."""
    spec_decode_num_accepted_tokens: int
    """Of those, the ones kept, since start."""
    spec_decode_accepted_per_position: tuple[int, ...]
    """[j]: drafts kept at a verification's position j (0: the first draft), since start."""
    kv_events_dropped_batches: int
    """KV-cache event batches not sent (the publisher's queue full, or ZeroMQ refusing), since start."""


@dataclass(frozen=True)
class ServingStats(EngineStats):
    """AsyncEngine's view: the core's stats as of its last step or command, and its own."""

    num_live_requests: int
    """Client requests (groups) from admission to their last output."""
    num_steps: int
    """Steps the engine task has run, since start."""
    alive: bool
    """False once a step failed and the engine task stopped."""
    accepting: bool
    """False once the server drains or closes: new requests get 503."""
    is_sleeping: bool
    """True from the start of a sleep until the wake-up: new requests get 503."""
