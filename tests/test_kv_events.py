"""KV-cache events (trillm/engine/kv_events.py): a served engine's events, read by a ZeroMQ
subscriber and decoded with vLLM's schema, rebuild its prefix cache exactly; the replay socket
gives back what a late subscriber missed; the config takes vLLM's keys."""
import json

import pytest
import trio
import zmq
from http_support import live_server, metric_value, settled_stats
from vllm_kv_events_schema import AllBlocksCleared, BlockRemoved, BlockStored, CacheReplica

from trillm.config import EngineArgs
from trillm.engine.api import EngineCore, EngineProcess
from trillm.engine.kv_events import KVEventBatch, KVEventsConfig, ZmqEventPublisher, offset_endpoint
from trillm.subprocesses import free_port

TOPIC = b"kv@test"


def replayed(port: int, start: int) -> list[tuple[int, bytes]]:
    """Every batch the replay socket holds from sequence number `start`: (seq, payload)."""
    with zmq.Context() as context, context.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        batches = []
        while True:
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                return batches
            assert topic == TOPIC
            batches.append((seq, payload))


def received(subscriber) -> list[tuple[int, bytes]]:
    batches = []
    while subscriber.poll(200):
        topic, seq, payload = subscriber.recv_multipart()
        assert topic == TOPIC
        batches.append((int.from_bytes(seq, "big"), payload))
    return batches


@pytest.mark.parametrize("hash_algo, link", [("builtin", "thread"), ("sha256_cbor", "thread"), ("builtin", "process")])
async def test_a_subscriber_rebuilds_the_prefix_cache_from_a_served_engines_events(hash_algo, link):
    """Requests that share prefixes in a pool small enough to evict, a flush, and more requests:
    replayed in order through vLLM's schema, the events hold exactly the blocks the allocator
    caches, with every kind of event among them; the live stream's batches are the replay's.
    With vLLM's hash the blocks are vLLM's 32-byte digests. The engine in its own process
    publishes from there."""
    pub, replay = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": TOPIC.decode()}
    core = (EngineProcess if link == "process" else EngineCore)(EngineArgs(
        num_kv_blocks=24, kv_events_config=json.dumps(config), prefix_caching_hash_algo=hash_algo))
    with core, zmq.Context() as context, context.socket(zmq.SUB) as subscriber:
        subscriber.connect(f"tcp://127.0.0.1:{pub}")
        subscriber.setsockopt(zmq.SUBSCRIBE, TOPIC)
        await trio.sleep(0.3)  # ZeroMQ drops what is published before the subscription lands
        async with live_server(core) as server:
            client, http = server.openai(), server.http()
            # eight stems of ~100 tokens: twice the pool's 24 blocks, so cached ones are evicted
            stems = [f"Chapter {n}. " + "The lighthouse keepers of the north coast kept a log. " * 8
                     for n in ("one", "two", "three", "four", "five", "six", "seven", "eight")]
            for turn in range(3):
                for stem in stems:
                    await client.completions.create(model=server.model, prompt=stem + f" turn {turn}:",
                                                    max_tokens=4, temperature=0)
                if turn == 1:
                    assert (await http.post("/flush_cache")).status_code == 200
            stats = await settled_stats(http)
            assert "trillm:kv_events_dropped_batches_total{" in (await http.get("/metrics")).text
            assert await metric_value(http, "trillm:kv_events_dropped_batches_total") == 0
        live = await trio.to_thread.run_sync(received, subscriber)
        log = await trio.to_thread.run_sync(replayed, replay, 0)
        assert [seq for seq, _ in log] == list(range(len(log)))
        assert live and set(live) <= set(log)
        replica = CacheReplica()
        kinds = set()
        for _, payload in log:
            batch = replica.apply(payload)
            assert batch.data_parallel_rank == 0
            kinds |= {type(event) for event in batch.events}
            for event in batch.events:
                if isinstance(event, BlockStored):
                    assert (event.block_size, event.medium, event.lora_id) == (16, "GPU", None)  # vLLM-CPU says GPU too
                    assert isinstance(event.block_hashes[0], bytes if hash_algo == "sha256_cbor" else int)
        assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}
        assert replica.hashes and len(replica.hashes) == stats["num_cached_blocks"]
        if link == "thread":
            assert replica.hashes == core.scheduler.allocator.cached_keys
        assert [seq for seq, _ in await trio.to_thread.run_sync(replayed, replay, len(log) - 2)] == \
            [len(log) - 2, len(log) - 1]


def test_a_closed_publisher_drops_and_counts():
    port = free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}")
    with ZmqEventPublisher(config) as publisher:
        pass
    publisher.close()  # idempotent
    publisher.publish(KVEventBatch(ts=0.0, events=[]))
    assert publisher.dropped == 1


@pytest.mark.parametrize(("text", "words"), [
    ('{"publisher": "kafka"}', "unknown publisher"),
    ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events must be true or false"),
    ('{"replay_endpoint": 5558}', "replay_endpoint must be a string or null"),
    ('{"buffer_steps": 0}', "at least 1"),
    ('{"endpoint": "http://x:1"}', "not a tcp://"),
    ('{"flush_every": 3}', "unknown key 'flush_every'"),
    ("[1]", "takes a JSON object"),
])
def test_kv_events_config_refuses_what_it_cannot_take(text, words):
    with pytest.raises(ValueError, match=words):
        KVEventsConfig.parse(text)


def test_kv_events_config_takes_vllms_keys_and_a_replicas_ports_follow_its_rank():
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", "replay_endpoint": '
                                  '"tcp://*:5560", "hwm": 10, "topic": "t"}')
    assert config.enabled and (config.endpoint, config.replay_endpoint, config.hwm) == ("tcp://*:5557", "tcp://*:5560", 10)
    assert not KVEventsConfig.parse(None).enabled
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": true}').enabled  # the null publisher
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"


async def test_an_adapters_blocks_are_keyed_and_told_as_vllm_keys_them(tiny_text_model_dir):
    """With sha256_cbor, a request for a LoRA adapter keys its blocks with vLLM's extra keys
    (("lora", name, path) on each block, the salt on the first), which its events carry
    untagged beside the adapter's name; the base model's blocks of the same tokens differ."""
    from lora_support import make_adapter

    from trillm.sched_ext import BlockAllocator, vllm_extra_keys

    adapter = make_adapter(tiny_text_model_dir, seed=1)
    replay = free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{free_port()}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": TOPIC.decode()}
    core = EngineCore(EngineArgs(model=tiny_text_model_dir, num_kv_blocks=32, enable_lora=True,
                                 lora_modules=f"sql={adapter}", kv_events_config=json.dumps(config),
                                 prefix_caching_hash_algo="sha256_cbor"))
    prompt = list(range(100, 135))  # two full blocks
    with core:
        async with live_server(core) as server:
            client = server.openai()
            for model, salt in (("sql", "tenant-a"), (server.model, None)):
                await client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                                extra_body={"cache_salt": salt} if salt else {})
            await settled_stats(server.http())
        replica = CacheReplica()
        stored = [event for _, payload in await trio.to_thread.run_sync(replayed, replay, 0)
                  for event in replica.apply(payload).events if isinstance(event, BlockStored)]
    expected: list = []
    BlockAllocator(4, 16, hash_algo="sha256_cbor").match_prefix(prompt, expected, 2, "tenant-a",
                                                                vllm_extra_keys("sql", adapter, "tenant-a"))
    lora = [e for e in stored if e.lora_name == "sql"]
    assert [e.block_hashes[0] for e in lora] == expected
    assert [e.extra_keys for e in lora] == [[("sql", "tenant-a")], [("sql",)]]
    base = [e for e in stored if e.lora_name is None]
    assert len(base) == 2 and not {e.block_hashes[0] for e in base} & set(expected)
