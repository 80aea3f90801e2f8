"""Prometheus metrics, one registry per server (tests start several in one process).

Names follow vLLM's where one exists (`num_requests_running`, `time_to_first_token_seconds`,
`inter_token_latency_seconds`), with the prefix `dspine_`.
"""

from __future__ import annotations

import bisect
import itertools
import math

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

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
        self.device_seconds = Counter("dspine_device_seconds", "Seconds the device ran "
                                      "the engine's calls, by call (prefill, decode), and "
                                      "sat idle between one call's end and the next launch "
                                      "(idle: the host's share).", ["call"], registry=r)
        for call in ("prefill", "decode", "idle"):
            self.device_seconds.labels(call=call)
        self._device_seen: dict[str, float] = {}
        self.accept = LoopHistogram("dspine_accept_length", "Tokens emitted per target "
                                    "pass (1 for AR; up to the drafter's block size).",
                                    tuple(range(1, max_accept + 1)), registry=r)
        self.verify_width = LoopHistogram(
            "dspine_verify_width", "Drafted tokens each target pass verified (0: a plain "
            "AR step; adaptive speculation picks per decode call).",
            (0, 1, 3, 7, 15, 31, 63), registry=r)
        self.ttft = Histogram("dspine_time_to_first_token_seconds", "Arrival to first "
                              "token.", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = LoopHistogram("dspine_inter_token_latency_seconds", "Time per output "
                                 "token after the first (a burst of k tokens after dt counts "
                                 "k x dt/k).", LATENCY_BUCKETS, registry=r)
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
        for call, seconds in stats.device_seconds.items():
            new = seconds - self._device_seen.get(call, 0.0)
            if new > 0:
                self.device_seconds.labels(call=call).inc(new)
                self._device_seen[call] = seconds

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LoopHistogram:
    """A Prometheus histogram for the per-token and per-pass series, which the server's
    event loop alone updates and reads (`observe` in the request handlers, the scrape in
    /metrics): no lock, and k equal observations in one call. prometheus_client's
    Histogram takes a lock and one call per observation; at 64 streams its per-token calls
    were a sixth of the event loop's time."""

    def __init__(self, name: str, documentation: str, buckets, *, registry):
        self.name, self.documentation = name, documentation
        self.bounds = [float(b) for b in buckets] + [math.inf]
        self.counts = [0] * len(self.bounds)      # per bucket, not cumulative
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative = itertools.accumulate(self.counts)
        family.add_metric([], [(floatToGoString(b), c) for b, c in zip(self.bounds, cumulative)],
                          self.sum)
        yield family
