"""Prometheus metrics, one registry per server (tests start several in one process).

Names follow vLLM's where one exists (`num_requests_running`, `time_to_first_token_seconds`,
`inter_token_latency_seconds`), with the prefix `dspine_`.
"""

from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

from dspine_jax.runtime.engine_core import EngineStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                   0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, *, max_accept: int = 17):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dspine_requests", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)
        self.errors = Counter("dspine_request_errors", "Requests answered with an error, by "
                              "HTTP status.", ["status"], registry=r)
        self.prompt_tokens = Counter("dspine_prompt_tokens", "Prompt tokens of admitted "
                                     "requests.", registry=r)
        self.generation_tokens = Counter("dspine_generation_tokens", "Generated tokens.",
                                         registry=r)
        self.running = Gauge("dspine_num_requests_running", "Requests in a slot.",
                             registry=r)
        self.waiting = Gauge("dspine_num_requests_waiting", "Requests queued for a slot.",
                             registry=r)
        self.slots = Gauge("dspine_slots", "Slots (rows decoded together).", registry=r)
        self.capacity = Gauge("dspine_cache_capacity_tokens", "KV positions in the page "
                              "pool (pages x page size).", registry=r)
        self.cache_used = Gauge("dspine_cache_used_tokens", "KV positions held by running "
                                "requests.", registry=r)
        self.pages = Gauge("dspine_cache_pages", "KV pages in the pool the slots share.",
                           registry=r)
        self.free_pages = Gauge("dspine_cache_free_pages", "KV pages held by no request.",
                                registry=r)
        self.cache_usage = Gauge("dspine_cache_usage_ratio", "Pages held / pages in the "
                                 "pool.", registry=r)
        self.preemptions = Counter("dspine_num_preemptions", "Requests preempted for KV "
                                   "pages (recomputed later).", registry=r)
        self._preemptions_seen = 0
        self.accept = Histogram("dspine_accept_length", "Tokens emitted per target pass "
                                "(1 for AR; up to the drafter's block size).",
                                buckets=tuple(range(1, max_accept + 1)), registry=r)
        self.verify_width = Histogram(
            "dspine_verify_width", "Drafted tokens each target pass verified (0: a plain "
            "AR step; adaptive speculation picks per decode call).",
            buckets=(0, 1, 3, 7, 15, 31, 63), registry=r)
        self.ttft = Histogram("dspine_time_to_first_token_seconds", "Arrival to first "
                              "token.", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dspine_inter_token_latency_seconds", "Time per output token "
                             "after the first (a burst of k tokens after dt counts k x dt/k).",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("dspine_e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=LATENCY_BUCKETS, registry=r)

    def observe_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.slots.set(stats.max_slots)
        self.capacity.set(stats.capacity_tokens)
        self.cache_used.set(stats.used_tokens)
        self.pages.set(stats.num_pages)
        self.free_pages.set(stats.free_pages)
        self.cache_usage.set(stats.cache_usage)
        # the engine counts from its start; the counter takes what is new since last time
        new = stats.preemptions - self._preemptions_seen
        if new > 0:
            self.preemptions.inc(new)
            self._preemptions_seen = stats.preemptions

    def render(self) -> bytes:
        return generate_latest(self.registry)
