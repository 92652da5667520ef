"""Prometheus metrics, named as vLLM's with the `trillm:` prefix (or, with `--metrics-prefix
vllm`, vLLM's own names, which the Gateway API Inference Extension's endpoint picker reads:
num_requests_waiting, num_requests_running, kv_cache_usage_perc), so dashboards carry over.

Each app has its own registry (not prometheus_client's global one): tests and
embedders may build several apps in one process. Per-request counters and
histograms are updated by the request handlers; the engine's gauges and its
prefix-cache counters are read from its stats snapshot at scrape time.
"""
from __future__ import annotations

import os
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trillm.engine.api import FinishReason, ServingStats
from trillm.http.settings import METRICS_DIR_VARIABLE

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0,
)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)
# Read from the engine's stats at scrape time: (name after the prefix, help, ServingStats field, kind).
ENGINE_METRICS = (
    ("num_requests_running", "Requests in the running batch.", "num_running", GaugeMetricFamily),
    ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting", GaugeMetricFamily),
    (
        "kv_cache_usage_perc",
        "KV-cache blocks held by live requests (0 to 1); prefix-cached blocks nobody holds do not count.",
        "kv_cache_usage",
        GaugeMetricFamily,
    ),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries",
     CounterMetricFamily),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits", CounterMetricFamily),
    ("num_preemptions", "Requests preempted (their KV cache recomputed later).", "num_preemptions",
     CounterMetricFamily),
    ("spec_decode_num_drafts", "Speculative decoding: decodes that verified drafts.", "spec_decode_num_drafts",
     CounterMetricFamily),
    ("spec_decode_num_draft_tokens", "Draft tokens verified.", "spec_decode_num_draft_tokens", CounterMetricFamily),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_decode_num_accepted_tokens",
     CounterMetricFamily),
    ("kv_events_dropped_batches", "KV-cache event batches not sent (--kv-events-config): the queue was full.",
     "kv_events_dropped_batches", CounterMetricFamily),
)


class Metrics:
    def __init__(self, model_name: str, engine_stats: Callable[[], ServingStats], prefix: str = "trillm",
                 max_loras: int | None = None, cache_config: dict[str, str] | None = None):
        """`prefix`: every name's, before its colon (trillm, or vllm). `max_loras`: with LoRA on,
        the adapters a step may run, for vLLM's lora_requests_info (None: LoRA is off).
        `cache_config`: the KV cache's settings as labels of vLLM's cache_config_info, which the
        Gateway API Inference Extension reads for block_size (num_gpu_blocks, the pool's size in
        blocks whatever the device, is added from the stats)."""
        self.registry = CollectorRegistry()
        engine = _EngineCollector(model_name, engine_stats, prefix, max_loras, cache_config or {})
        if os.environ.get(METRICS_DIR_VARIABLE):
            # Several fronts (--api-server-count): each writes its counts to the shared files, and a
            # scrape, whichever front takes it, sums every front's (the engine's gauges are one).
            self._scraped = CollectorRegistry()
            MultiProcessCollector(self._scraped)
            self._scraped.register(engine)
        else:
            self.registry.register(engine)
            self._scraped = self.registry
        by_model = dict(labelnames=["model_name"], registry=self.registry)

        def counter(name: str, doc: str):
            return Counter(f"{prefix}:{name}", doc, **by_model).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple):
            return Histogram(f"{prefix}:{name}", doc, buckets=buckets, **by_model).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.time_to_first_token = histogram("time_to_first_token_seconds", "To first token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Between two outputs.", ITL_BUCKETS)
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self._success = Counter(
            f"{prefix}:request_success", "Finished requests, by finish reason.",
            labelnames=["model_name", "finished_reason"], registry=self.registry,
        )
        self._model_name = model_name

    def finished(self, reason: FinishReason) -> None:
        self._success.labels(self._model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self._scraped)


class _EngineCollector:
    def __init__(self, model_name: str, engine_stats: Callable[[], ServingStats], prefix: str, max_loras: int | None,
                 cache_config: dict[str, str]):
        self._model_name = model_name
        self._stats = engine_stats
        self._prefix = prefix
        self._max_loras = max_loras
        self._cache_config = cache_config

    def collect(self):
        stats = self._stats()
        # vLLM's shape: an info gauge, the settings in its labels and 1 as its value
        labels = {**self._cache_config, "num_gpu_blocks": str(stats.num_kv_blocks)}
        cache_info = GaugeMetricFamily(f"{self._prefix}:cache_config_info", "The KV cache's configuration.",
                                       labels=list(labels))
        cache_info.add_metric(list(labels.values()), 1)
        yield cache_info
        for name, doc, key, family in ENGINE_METRICS:
            metric = family(f"{self._prefix}:{name}", doc, labels=["model_name"])
            metric.add_metric([self._model_name], getattr(stats, key))
            yield metric
        per_position = CounterMetricFamily(f"{self._prefix}:spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted, by their position in the draft.",
                                           labels=["model_name", "position"])
        for position, accepted in enumerate(stats.spec_decode_accepted_per_position):
            per_position.add_metric([self._model_name, str(position)], accepted)
        yield per_position
        if self._max_loras is not None:
            # vLLM's shape: the adapters are in the labels, the value is when they were read
            info = GaugeMetricFamily(f"{self._prefix}:lora_requests_info", "Running and waiting LoRA adapters.",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([str(self._max_loras), ",".join(stats.running_lora_adapters),
                             ",".join(stats.waiting_lora_adapters)], time.time())
            yield info
