"""KV-cache events in vLLM's wire format, for the routers that route by cache (llm-d's precise
prefix-cache scorer, Dynamo's KV router, the SGLang gateway's event mode).

The allocator logs each full block entering the prefix cache, each cached block evicted and each
flush (BlockAllocator.take_events); after every step the engine turns the step's log into one
`KVEventBatch` and hands it to the publisher. `--kv-events-config` takes vLLM's JSON keys:

    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
     "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000,
     "max_queue_size": 100000, "topic": ""}

As vLLM's publisher: a ZeroMQ PUB socket sends each batch as three frames (topic, an 8-byte
big-endian sequence number, the msgpack batch), and a ROUTER socket on `replay_endpoint` answers
a subscriber that missed batches: it sends an 8-byte start sequence number and gets every
buffered batch from there (the last `buffer_steps`), then an end frame of sequence -1. A
data-parallel replica's ports are the endpoints' plus its rank, and its batches carry the rank.

The publisher never holds up a step: `publish` only puts the batch on a bounded queue, which a
thread of its own drains onto the sockets; a batch that finds the queue full is dropped and
counted (`dropped`, served as `kv_events_dropped_batches` in /metrics), as is one ZeroMQ
refuses. A subscriber that sees a gap in the sequence numbers asks the replay socket.

The events carry the token ids of every cached block, so of users' prompts: a subscriber sees
what was asked. Bind the endpoints to a private address (`tcp://10.0.0.5:5557`, not `*`) or
keep them behind the cluster's network policy, as for vLLM's.

Block hashes are trillm's prefix-cache keys (sched_ext/allocator.pyx): a chain, each block's key
the hash of its parent's key and its tokens, the first block's tokens preceded by the request's
cache salt (its `cache_salt`, followed for a LoRA adapter by "\\0lora-<id>"), which the event
also carries as the block's extra key. Python's hash of integers is the same in every process,
so unsalted keys are reproducible; a salt's hash is not, unless PYTHONHASHSEED is fixed. With
--prefix-caching-hash-algo sha256_cbor the keys are vLLM's, and the events carry vLLM's extra
keys (an adapter's name on every block, the salt on the first).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec

from trillm.config import from_json_object
from trillm.sched_ext.status import KVCacheEventKind

log = logging.getLogger("trillm.kv_events")

BlockHash = int | bytes
# A block's tier in vLLM's events: "GPU" is the engine's own KV cache on any device (vLLM-CPU's
# says "GPU" too), "CPU" an offloaded host copy, which routers credit less (vllm-router: 0.8 of
# a hit), so trillm's one pool is "GPU" on CPU as well.
PRIMARY_MEDIUM = "GPU"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One event; encoded as a map tagged with its class name, as vLLM's."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # per block: a salted first block's salt; with sha256_cbor keys vLLM's untagged extra keys
    # (an adapter's name on every block, then the salt on the first)
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A step's events, encoded as the array [ts, events, data_parallel_rank]."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


@dataclass(frozen=True)
class KVEventsConfig:
    """`--kv-events-config`, vLLM's keys and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # null | zmq
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"--kv-events-config: unknown publisher {self.publisher!r}; this server has null and zmq.")
        if min(self.buffer_steps, self.hwm, self.max_queue_size) < 1:
            raise ValueError("--kv-events-config: buffer_steps, hwm and max_queue_size must be at least 1.")
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"--kv-events-config: endpoint {endpoint!r} is not a tcp://, ipc:// or inproc:// address.")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig:
        """The config a `--kv-events-config` JSON object gives (None or "": off); ValueError,
        naming the key, for anything it cannot take."""
        if not text:
            return cls()
        return from_json_object(cls, "--kv-events-config", text)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """A data-parallel replica's endpoint: a tcp port plus its rank (port 0 stays 0: the system
    picks), other addresses suffixed with `_dp<rank>`; rank 0's unchanged."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def event_batch(raw: list[tuple], block_size: int, rank: int | None, lora_names: dict[int, str]) -> KVEventBatch:
    """The allocator's logged events (KVCacheEventKind tuples) as one batch, stamped now.
    `lora_names`: adapter id -> name, for a stored block's lora_name."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for event in raw:
        kind = event[0]
        if kind == KVCacheEventKind.BLOCK_STORED:
            _, key, parent, tokens, keys, lora_id = event
            events.append(BlockStored(
                block_hashes=[key], parent_block_hash=parent, token_ids=list(tokens), block_size=block_size,
                lora_id=lora_id or None, medium=PRIMARY_MEDIUM, lora_name=lora_names.get(lora_id) if lora_id else None,
                extra_keys=[keys] if keys else None))
        elif kind == KVCacheEventKind.BLOCK_REMOVED:
            events.append(BlockRemoved(block_hashes=[event[1]], medium=PRIMARY_MEDIUM))
        else:
            assert kind == KVCacheEventKind.ALL_BLOCKS_CLEARED, event
            events.append(AllBlocksCleared())
    return KVEventBatch(ts=time.time(), events=events, data_parallel_rank=rank)


class ZmqEventPublisher:
    """Sends batches on a PUB socket and answers replay requests on a ROUTER socket, from a
    thread of its own; see the module docstring. `publish` never blocks. `close()` is idempotent
    and stops the thread within a second; a context manager closes it."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, rank: int = 0):
        import zmq

        self.config = config
        self.endpoint = offset_endpoint(config.endpoint, rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, rank)
        self._refused = 0  # batches the full queue refused (counted by publish's thread)
        self._unsent = 0  # batches ZeroMQ refused (counted by the publisher's thread)
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            self._attach(self._pub, self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._context.destroy(linger=0)
            raise ValueError(f"--kv-events-config: cannot open {self.endpoint}: {e}") from None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-events publisher", daemon=True)
        self._thread.start()

    @staticmethod
    def _attach(socket, endpoint: str) -> None:
        """Bind a wildcard, ipc or inproc address; connect to any other (vLLM's rule)."""
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)

    @property
    def dropped(self) -> int:
        """Batches not sent: refused by the full queue, or by ZeroMQ (those are kept for replay)."""
        return self._refused + self._unsent

    def publish(self, batch: KVEventBatch) -> None:
        """Queue `batch` for sending; dropped (and counted) if the queue is full or closed."""
        if self._closed:
            self._refused += 1
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._refused += 1

    def _run(self) -> None:
        import zmq

        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._answer_replay()
                except zmq.ZMQError:  # one subscriber's broken request must not stop the stream
                    log.exception("kv events: a replay request failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                self._unsent += 1  # kept for replay all the same
            self._buffer.append((seq, payload))
            seq += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events: a replay request of %d frames, not 3, ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", self.END_SEQ, b""))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(timeout=1.0)
        self._context.destroy(linger=0)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
