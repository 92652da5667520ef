"""The wiring of the replicas' KV-cache events to vllm-router (--router-policy kv_aware): where
the router subscribes for each replica, the loopback proxy the supervisor puts between them,
and the operator's configs it keeps or refuses."""
import json

import pytest
import zmq

from trillm.engine.kv_events import KVEventsConfig
from trillm.launch.router_events import RouterEvents

URLS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


def config(**keys) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", **keys})


def test_an_operator_config_that_binds_is_kept_and_read_on_loopback():
    """Each replica gets the operator's keys, its ports offset by its index (it runs as rank 0,
    the only rank vllm-router takes from one worker)."""
    text = config(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600", buffer_steps=7)
    with RouterEvents(text, 2) as events:
        assert [json.loads(events.engine_config(i)) for i in range(2)] == [
            {**json.loads(text), "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600"},
            {**json.loads(text), "endpoint": "tcp://*:5558", "replay_endpoint": "tcp://*:5601"}]
        sources = events.sources(URLS)
        flags = events.router_flags(URLS, 16, "m")
    assert [(s.worker, s.endpoint, s.replay) for s in sources] == [
        (URLS[0], "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5600"),
        (URLS[1], "tcp://127.0.0.1:5558", "tcp://127.0.0.1:5601")]
    assert flags == [
        "--kv-event-source", f"{URLS[0]}=tcp://127.0.0.1:5557", "--kv-event-replay-source", f"{URLS[0]}=tcp://127.0.0.1:5600",
        "--kv-event-source", f"{URLS[1]}=tcp://127.0.0.1:5558", "--kv-event-replay-source", f"{URLS[1]}=tcp://127.0.0.1:5601",
        "--kv-event-block-size", "16", "--kv-event-model", "m"]
    with RouterEvents(config(endpoint="tcp://*:5557", replay_endpoint="ipc:///tmp/replay"), 1) as events:
        assert events.sources(URLS[:1])[0].replay is None  # the router reads tcp alone


@pytest.mark.parametrize("endpoint", ["tcp://10.0.0.5:5557", "tcp://*:0", "ipc:///tmp/kv"])
def test_an_operator_config_the_router_cannot_reach_is_refused(endpoint):
    with pytest.raises(ValueError, match="endpoint they bind"):
        RouterEvents(config(endpoint=endpoint), 2)


def test_without_a_config_the_replicas_publish_through_loopback_proxies():
    """Each replica's PUB (connecting, by vLLM's rule) reaches the router's SUB through the
    proxy bound on 127.0.0.1; nothing listens on another interface."""
    events = RouterEvents(None, 2)
    context = zmq.Context()
    try:
        engines = [KVEventsConfig.parse(events.engine_config(i)) for i in range(2)]
        assert all(e.enabled and e.endpoint.startswith("tcp://127.0.0.1:") for e in engines)
        sources = events.sources(URLS)
        assert [s.replay for s in sources] == [e.replay_endpoint for e in engines]
        assert all(s.endpoint.startswith("tcp://127.0.0.1:") and s.replay.startswith("tcp://127.0.0.1:")
                   for s in sources)
        for rank, (source, engine) in enumerate(zip(sources, engines)):
            sub = context.socket(zmq.SUB)
            sub.connect(source.endpoint)
            sub.subscribe(b"")
            pub = context.socket(zmq.PUB)
            pub.connect(engine.endpoint)
            sub.RCVTIMEO = 100
            for _ in range(100):  # until the subscription has reached the publisher
                pub.send_multipart([b"", b"seq", f"rank {rank}".encode()])
                try:
                    assert sub.recv_multipart() == [b"", b"seq", f"rank {rank}".encode()]
                    break
                except zmq.Again:
                    continue
            else:
                pytest.fail(f"nothing reached the router's side of rank {rank}'s proxy")
            pub.close(linger=0)
            sub.close(linger=0)
    finally:
        events.close()
        events.close()  # idempotent
        context.destroy(linger=0)
