"""`trillm serve --data-parallel-size N`: N engine replicas behind vllm-router.

This process is a supervisor, not a server. It starts N replicas, each a plain `trillm serve`
on a loopback port, with its own KV cache and its own even share of the cores. Then it starts
vllm-router (the Rust load balancer from PyPI, version pinned in pyproject.toml) on the
public --host / --port. Each of them is forked from one fork server that imported the server
once (trillm.subprocesses.start_preloaded), rather than N + 1 interpreters each importing it;
the log names each one's process id. The router routes each request to a replica by
--router-policy: cache_aware (by the longest prefix it sent there before, unless the load is
uneven), kv_aware (by the blocks each replica reports it caches, from their KV-cache events:
trillm/launch/router_events.py), round_robin, power_of_two or random. URLs in
--data-parallel-address, which are `trillm serve` processes on other machines, join the
router's worker list beside the local ones; with `--data-parallel-size 0` there are no local
ones, and this host is the front door alone.

The router forwards a route it does not balance (adapters, /abort_request, /sleep, ...) to one
replica; each replica is given the others as --data-parallel-peers and relays such calls to
them (trillm/http/peer_relay.py), so they reach every replica.

The router checks each worker's /health every HEALTH_INTERVAL seconds and takes one out of
rotation after HEALTH_FAILURES failed checks (the router's defaults, a minute and three,
would leave a replica whose host is gone in rotation for minutes, every request sent there
waiting on it); it comes back after two good checks.

Why vllm-router (a fork of sglang-router, which served here before): both keep a prefix tree
per worker for cache_aware, but sglang-router answers 404 to every route it does not know, so
no adapter load or abort reached any replica through it, and it cannot read KV-cache events;
vllm-router forwards unknown routes and has kv_aware. It speaks plain OpenAI HTTP to any
backend (writing vLLM's include_reasoning into chat requests, which trillm takes), and for
cache and kv_aware asks a worker for a prompt's tokens (/tokenize, after vLLM's
/v1/completions/render, which trillm does not serve). With --api-key, the replicas take the
key from their environment and the router is handed it as its api_key (its own calls, to
/health and /get_load, need none); both get it through the fork server's socket, and no
command line carries it.

Lifetime: the replicas and the router die with the fork server (PR_SET_PDEATHSIG), which ends
with the supervisor, however it ends. On SIGTERM or SIGINT the supervisor stops the router
first (no new requests), then sends SIGTERM to the replicas, which drain as any `trillm serve`
does. A replica that dies is logged and left out: the router's health checks take it out of
rotation and the others serve on. If the router dies, or the last replica, the supervisor
stops the rest and exits with an error.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
import urllib.error
import urllib.request
from dataclasses import replace
from multiprocessing import Process
from typing import TYPE_CHECKING

from trillm.config import default_kv_cache_memory
from trillm.direct_http import PROXY_VARIABLES, open_direct
from trillm.http.settings import API_KEY_VARIABLE, RouterPolicy, ServerSettings, to_argv
from trillm.subprocesses import SERVER, cpu_share, free_port, start_preloaded

if TYPE_CHECKING:
    from trillm.launch.router_events import RouterEvents

log = logging.getLogger(__name__)
READY_TIMEOUT = 600.0  # seconds for a replica to load its model and answer /health
ROUTER_READY_TIMEOUT = 60.0  # seconds for the router, which loads nothing, to answer /health
STOP_TIMEOUT = 60.0  # seconds the router and the replicas get to exit on a signal, before SIGKILL
HEALTH_INTERVAL = 2  # seconds between the router's /health checks of a worker
HEALTH_TIMEOUT = 2  # seconds a check may take before it counts as failed
HEALTH_FAILURES = 2  # failed checks in a row that take a worker out of rotation


def router_argv(settings: ServerSettings, port: int, metrics_port: int, worker_urls: list[str]) -> list[str]:
    """vllm-router's flags: the public address, and its own metrics on `metrics_port` of the same
    host (the default port is fixed, so a second router on the host could not start)."""
    return ["--worker-urls", *worker_urls, "--policy", settings.router_policy.value, "--host", settings.host,
            "--port", str(port), "--prometheus-host", settings.host, "--prometheus-port", str(metrics_port),
            "--log-level", "warning",
            "--health-check-interval-secs", str(HEALTH_INTERVAL), "--health-check-timeout-secs", str(HEALTH_TIMEOUT),
            "--health-failure-threshold", str(HEALTH_FAILURES)]


def run(settings: ServerSettings) -> int:
    """Supervise the replicas and the router until a signal, or until one of them exits; the
    exit status for the command (0 after a signal)."""
    count = settings.data_parallel_size  # ServerSettings checked it: >= 1, or 0 with addresses
    ports = [free_port() for _ in range(count)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    workers = urls + ServerSettings.as_list(settings.data_parallel_address or "")
    events = None
    if settings.router_policy == RouterPolicy.KV_AWARE and count > 0:
        # here, not above: through the engine's door it imports torch, which other supervisors skip
        from trillm.launch.router_events import RouterEvents

        events = RouterEvents(settings.engine.kv_events_config, count)
    replicas = []
    children = []
    try:
        # the replicas share this machine's memory: each takes its part of the KV cache's default budget
        kv_cache_memory = settings.engine.kv_cache_memory
        if kv_cache_memory is None and count > 0:
            kv_cache_memory = default_kv_cache_memory(count)
        for index, (port, url) in enumerate(zip(ports, urls)):
            engine = replace(settings.engine, data_parallel_rank=index, kv_cache_memory=kv_cache_memory)
            if events is not None:  # vllm-router takes each replica for a worker of rank 0
                engine = replace(engine, data_parallel_rank=0, kv_events_config=events.engine_config(index))
            replica = replace(settings, host="127.0.0.1", port=port, data_parallel_size=1,
                              data_parallel_address=None, api_key=None, engine=engine,
                              data_parallel_peers=",".join(w for w in workers if w != url) or None)
            # not daemons: a replica with --tensor-parallel-size starts its ranks
            replicas.append(start_preloaded(_replica_main, to_argv(replica), settings.api_key, preload=SERVER,
                                            daemon=False, cpus=cpu_share(index, count)))
            replicas[-1].name = f"replica {index}"  # what the log calls it
            children.append(replicas[-1])
        return _supervise(settings, urls, workers, replicas, children, events)
    finally:
        _stop(children)
        if events is not None:
            events.close()


def _supervise(settings: ServerSettings, urls: list[str], workers: list[str], replicas: list[Process],
               children: list[Process], events: RouterEvents | None) -> int:
    """`run`'s watch, once the replicas are started: the router once they are ready, then both
    until a signal or an exit. Adds the router to `children`."""
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    for url, replica in zip(urls, replicas):
        log.info("%s (pid %d): %s", replica.name, replica.pid, url)
    if not _wait_ready(urls, replicas, stopping, READY_TIMEOUT):
        return 0 if stopping else 1
    port = settings.port or free_port()  # port 0: any free one, logged below
    metrics_port = free_port()
    argv = router_argv(settings, port, metrics_port, workers)
    if events is not None:
        argv += events.router_flags(urls, settings.engine.block_size, _served_model(urls[0], settings.api_key))
    router = start_preloaded(_router_main, argv, settings.api_key, preload=SERVER, daemon=False)
    router.name = "the router"
    children.insert(0, router)
    if not _wait_ready([f"http://{_loopback(settings.host)}:{port}"], [router], stopping, ROUTER_READY_TIMEOUT):
        return 0 if stopping else 1
    log.info("the router's own metrics (requests, workers, retries): http://%s:%d/metrics; each replica's at its "
             "address", settings.host, metrics_port)
    log.info("%d replicas behind vllm-router (%s) on http://%s:%d",
             len(workers), settings.router_policy, settings.host, port)
    alive = dict(zip(replicas, urls))
    while not stopping:
        if router.exitcode is not None:
            log.error("the router exited (status %s): stopping the replicas", router.exitcode)
            return 1
        for replica in [r for r in alive if r.exitcode is not None]:
            log.error("%s (%s) exited (status %s); the others serve on", replica.name, alive.pop(replica),
                      replica.exitcode)
        if replicas and not alive:
            log.error("every replica exited: stopping the router")
            return 1
        time.sleep(0.2)
    return 0


def _replica_main(argv: list[str], api_key: str | None) -> None:
    """A replica, in its forked process: `trillm serve` with `argv`, with the key (if any) where
    a replica reads it, in its environment (and no key it was not given)."""
    from trillm.launch.cli import main

    os.environ.pop(API_KEY_VARIABLE, None)
    if api_key is not None:
        os.environ[API_KEY_VARIABLE] = api_key
    main(["serve", *argv])


def _router_main(argv: list[str], api_key: str | None) -> None:
    """The router, in its forked process: vllm-router's launcher with `argv`, sending `api_key`
    (if any) on its own calls to the replicas, and no proxy the environment names: it talks to
    the replicas alone, and its HTTP client would send even loopback calls through one."""
    from vllm_router.launch_router import launch_router, parse_router_args

    for variable in PROXY_VARIABLES:
        os.environ.pop(variable, None)
    args = parse_router_args(argv)
    args.api_key = api_key
    launch_router(args)


def _served_model(url: str, api_key: str | None) -> str:
    """The model name a ready replica serves (its /v1/models' first entry)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with open_direct(urllib.request.Request(url + "/v1/models", headers=headers), 10) as response:
        return json.loads(response.read())["data"][0]["id"]


def _loopback(host: str) -> str:
    """Where this machine reaches a server bound to `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _wait_ready(urls: list[str], processes: list[Process], stopping: list, timeout: float) -> bool:
    """Until every URL's /health answers 200, `processes` serving them in order: False if one of
    them exits first or `timeout` seconds pass (either logged, naming which), or a signal comes."""
    deadline = time.monotonic() + timeout
    waiting = list(urls)
    while waiting and not stopping and time.monotonic() < deadline:
        exited = [p for p in processes if p.exitcode is not None]
        if exited:
            log.error("%s exited while starting (status %s)", exited[0].name, exited[0].exitcode)
            return False
        for url in list(waiting):
            try:
                with open_direct(url + "/health", 2) as response:
                    if response.status == 200:
                        waiting.remove(url)
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(0.2)
    if waiting and not stopping:
        names = {url: process.name for url, process in zip(urls, processes)}
        log.error("%s did not answer /health within %g s: stopping", ", ".join(
            f"{names[url]} ({url})" if url in names else url for url in waiting), timeout)
    return not waiting and not stopping


def _stop(children: list[Process]) -> None:
    """SIGTERM to each in order (the router first), then wait for all; SIGKILL the late."""
    for child in children:
        if child.exitcode is None:
            child.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT
    for child in children:
        child.join(max(deadline - time.monotonic(), 0))
        if child.exitcode is None:
            child.kill()
            child.join()
