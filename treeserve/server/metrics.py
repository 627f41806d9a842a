"""Prometheus metrics of the server: HTTP requests, tokens, latencies, and engine state.

Owns one `CollectorRegistry` per app (so several apps in one process do not collide).
Counters and histograms are updated by the routes; engine state (requests running and
waiting, KV pages used and cached, prefix-cache hit rate and tail hits, preemptions, evictions, thrash:
`engine_stats`) is read at scrape time, from the runtime in this process or from the report
the engine-core process sends. `RequestCounter` is a plain ASGI middleware that counts every
response by route and status, including 401s and validation errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from treeserve.runtime.runtime import Runtime

ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/search", "/v1/prm/score", "/health", "/metrics")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def engine_stats(runtime: Runtime) -> dict[str, dict[str, float]]:
    """Per hosted model, the engine state `/metrics` reports (plain numbers: the engine-core
    process sends this to the API process)."""
    stats = {}
    for name, engine in runtime.engines.items():
        status, cache = engine.status, engine.pages.stats
        values = {
            "num_requests_running": status["running"],
            "num_requests_waiting": status["waiting"],
            "kv_pages_used": status["pages_used"],
            "kv_pages_cached": status["pages_cached"],
            "kv_pages_total": status["pages_total"],
            "prefix_cache_hit_rate": cache.hit_rate,
            "preemptions": status["preemptions"],
            "kv_evictions": cache.evictions,
            "kv_thrash": cache.thrash,
            "prefix_cache_tail_hits": cache.tail_hits,
        }
        if engine.speculator is not None:
            drafts = engine.speculator.stats  # under vLLM's metric names
            values |= {
                "spec_decode_num_drafts": drafts.num_drafts,
                "spec_decode_num_draft_tokens": drafts.num_draft_tokens,
                "spec_decode_num_accepted_tokens": drafts.num_accepted_tokens,
            }
        stats[name] = values
    return stats


GAUGES = {
    "num_requests_running": "sequences in the running batch",
    "num_requests_waiting": "sequences waiting to be scheduled",
    "kv_pages_used": "KV pages held by live sequences",
    "kv_pages_cached": "KV pages held only by the prefix cache (reusable, evictable)",
    "kv_pages_total": "KV pages the model can use (the whole arena when it is shared)",
    "prefix_cache_hit_rate": "share of looked-up full prompt pages found in the prefix cache",
}
COUNTERS = {
    "preemptions": "sequences preempted (recompute)",
    "kv_evictions": "cached pages of the model evicted",
    "kv_thrash": "prefix-cache misses on keys evicted before",
    "prefix_cache_tail_hits": "part-written last pages of ended sequences read instead of recomputed",
    "spec_decode_num_drafts": "speculative decoding: sequence-steps that verified drafted tokens",
    "spec_decode_num_draft_tokens": "speculative decoding: tokens drafted",
    "spec_decode_num_accepted_tokens": "speculative decoding: drafted tokens accepted",
}


class RuntimeCollector(Collector):
    """Engine state per hosted model, read when Prometheus scrapes (from `source`: the
    in-process runtime, or the engine core's last report)."""

    def __init__(self, source: Callable[[], dict[str, dict[str, float]]]):
        self.source = source

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        families = {k: GaugeMetricFamily(f"treeserve_{k}", doc, labels=["model"]) for k, doc in GAUGES.items()}
        counters = {k: CounterMetricFamily(f"treeserve_{k}", doc, labels=["model"]) for k, doc in COUNTERS.items()}
        for name, values in self.source().items():
            for key, value in values.items():
                (families.get(key) or counters[key]).add_metric([name], value)
        yield from families.values()
        yield from counters.values()


class ServerMetrics:
    def __init__(self, source: Callable[[], dict[str, dict[str, float]]]):
        """`source`: the engine state per model (`engine_stats` of a runtime, or the core's report)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "treeserve_http_requests", "HTTP responses by route and status", ["route", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "treeserve_prompt_tokens", "prompt tokens of finished requests", ["model"], registry=r
        )
        self.generation_tokens = Counter("treeserve_generation_tokens", "tokens generated", ["model"], registry=r)
        self.ttft = Histogram(
            "treeserve_time_to_first_token_seconds",
            "request arrival to first generated token",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "treeserve_inter_token_latency_seconds",
            "time between a request's engine steps that produced tokens",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.search_seconds = Histogram(
            "treeserve_search_seconds",
            "wall time of /v1/search requests",
            ["strategy"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.core_restarts = Counter(
            "treeserve_engine_core_restarts", "times the engine-core process was restarted", registry=r
        )
        r.register(RuntimeCollector(source))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestCounter:
    """ASGI middleware: count each HTTP response by route (known routes, else "other") and status."""

    def __init__(self, app: object, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
