"""`--router-policy kv_aware`: the replicas' KV-cache events, wired to vllm-router.

vllm-router's kv_aware policy keeps an index of which blocks each worker caches, built from the
workers' KV-cache events (trillm/engine/kv_events.py, vLLM's format), and sends a request where
most of its prompt is cached (and the load allows). It subscribes to each worker's ZeroMQ PUB
socket, and asks its replay socket for batches it missed.

The router only connects, and takes tcp:// endpoints alone; vLLM's rule (which the replicas
follow) binds a PUB endpoint only for a wildcard host, every interface, which would publish the
token ids of every prompt to the network. So when the replicas have no --kv-events-config, the
supervisor gives them one whose PUB endpoints connect to a ZeroMQ proxy (XSUB -> XPUB, one per
replica, in a thread of the supervisor) bound on 127.0.0.1, where the router subscribes; their
replay sockets (always bound) listen on 127.0.0.1 too. A --kv-events-config the operator gave
is kept when its endpoint is bound (tcp://*:PORT), the router subscribing beside the operator's
own subscribers; one that connects elsewhere cannot reach the router and is refused.

The router takes each replica for a worker of one data-parallel rank, and drops batches stamped
with another: the replicas run as rank 0, each with its own endpoints (an operator's ports plus
the replica's index, as ranks would have offset them).

Replicas on other hosts (--data-parallel-address) publish nothing here: the router scores them
by load alone.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import zmq

from trillm.engine.api import KVEventsConfig, offset_endpoint
from trillm.subprocesses import free_port

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class EventSource:
    """Where the router reads one replica's events."""

    worker: str  # the replica's URL, as the router knows it
    endpoint: str  # its PUB stream
    replay: str | None  # its replay socket


class _Proxy:
    """XSUB bound at `inlet` -> XPUB bound at `outlet`, in its own thread, until closed."""

    def __init__(self, context: zmq.Context, inlet: str, outlet: str, name: str):
        self._frontend = context.socket(zmq.XSUB)
        self._backend = context.socket(zmq.XPUB)
        self._control = context.socket(zmq.PAIR)
        self._stop = context.socket(zmq.PAIR)
        self._frontend.bind(inlet)
        self._backend.bind(outlet)
        self._control.bind(f"inproc://{name}")
        self._stop.connect(f"inproc://{name}")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            zmq.proxy_steerable(self._frontend, self._backend, None, self._control)
        finally:
            for socket in (self._frontend, self._backend, self._control):
                socket.close(linger=0)

    def close(self) -> None:
        self._stop.send(b"TERMINATE")
        self._thread.join()
        self._stop.close(linger=0)


class RouterEvents:
    """The events' wiring for `count` local replicas: the --kv-events-config each runs with
    (`engine_config(index)`) and the router's sources. Owns the proxies it starts; close()
    (idempotent; also on leaving a `with`) stops them."""

    def __init__(self, kv_events_config: str | None, count: int):
        """ValueError for an operator's config whose endpoint the router cannot reach."""
        self._context: zmq.Context | None = None
        self._proxies: list[_Proxy] = []
        self._outlets: list[str] = []
        config = check_config(kv_events_config)
        if config.enabled:
            self._keys = json.loads(kv_events_config)
            self._endpoints = [offset_endpoint(config.endpoint, i) for i in range(count)]
            self._replays = [offset_endpoint(config.replay_endpoint, i) for i in range(count)]
            return
        self._keys = {"enable_kv_cache_events": True, "publisher": "zmq"}
        self._endpoints = [f"tcp://{LOOPBACK}:{free_port()}" for _ in range(count)]
        self._replays = [f"tcp://{LOOPBACK}:{free_port()}" for _ in range(count)]
        self._context = zmq.Context()
        try:
            for index, inlet in enumerate(self._endpoints):
                outlet = f"tcp://{LOOPBACK}:{free_port()}"
                self._proxies.append(_Proxy(self._context, inlet, outlet, f"kv-events proxy {index}"))
                self._outlets.append(outlet)
        except BaseException:
            self.close()
            raise

    def engine_config(self, index: int) -> str:
        """The --kv-events-config of the replica at `index`, which runs as rank 0."""
        return json.dumps({**self._keys, "endpoint": self._endpoints[index], "replay_endpoint": self._replays[index]})

    def sources(self, urls: list[str]) -> list[EventSource]:
        """The router's source for each local replica, `urls` in index order."""
        sources = []
        for index, (url, replay) in enumerate(zip(urls, self._replays)):
            endpoint = self._outlets[index] if self._outlets else _reachable(self._endpoints[index])
            tcp = replay is not None and replay.startswith("tcp://") and not replay.endswith(":0")
            sources.append(EventSource(url, endpoint, _reachable(replay) if tcp else None))
        return sources

    def router_flags(self, urls: list[str], block_size: int, model: str) -> list[str]:
        """vllm-router's flags for the replicas at `urls`: each one's stream and replay socket,
        the block size and the model both sides name."""
        flags = []
        for source in self.sources(urls):
            flags += ["--kv-event-source", f"{source.worker}={source.endpoint}"]
            if source.replay:
                flags += ["--kv-event-replay-source", f"{source.worker}={source.replay}"]
        return [*flags, "--kv-event-block-size", str(block_size), "--kv-event-model", model]

    def close(self) -> None:
        for proxy in self._proxies:
            proxy.close()
        self._proxies = []
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    def __enter__(self) -> RouterEvents:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_config(kv_events_config: str | None) -> KVEventsConfig:
    """The replicas' --kv-events-config, if the router can subscribe to it (none, or one that
    binds a tcp port); ValueError, naming the flags, otherwise."""
    config = KVEventsConfig.parse(kv_events_config)
    if config.enabled and (not _is_bound(config.endpoint) or config.endpoint.endswith(":0")):
        raise ValueError("--router-policy kv_aware subscribes the router to the replicas' KV-cache events: give "
                         "--kv-events-config an endpoint they bind (tcp://*:PORT, a port other than 0), or none.")
    return config


def _is_bound(endpoint: str) -> bool:
    """Whether a replica binds this PUB endpoint (vLLM's rule, kv_events._attach), over tcp."""
    return endpoint.startswith("tcp://") and ("*" in endpoint or "::" in endpoint)


def _reachable(endpoint: str) -> str:
    """Where this host reaches a bound tcp endpoint: a wildcard host is reached on loopback."""
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return f"tcp://{LOOPBACK if host in ('*', '[::]', '::') else host}:{port}"
