"""`dspine bench serve`'s summary of one level, on synthetic request records whose
percentiles, throughputs and acceptance are known by construction."""

from __future__ import annotations

import math

import pytest

from dspine_serve.bench import RequestRecord, summarize


def records() -> list[RequestRecord]:
    """Ten finished requests: TTFT 0.1 .. 1.0 s, latency TTFT + 1 s, three gaps each
    (request i: 10 + i, 20 + i, 30 + i ms), 40 output tokens over 13 target passes;
    and two failures, whose numbers must not count."""
    done = [RequestRecord(ok=True, ttft=0.1 * i, latency=0.1 * i + 1.0,
                          itl=[(10 + i) / 1000, (20 + i) / 1000, (30 + i) / 1000],
                          prompt_tokens=100 + i, output_tokens=40, target_passes=13)
            for i in range(1, 11)]
    failed = [RequestRecord(error="HTTP 429: busy", ttft=50.0, itl=[9.0], output_tokens=999,
                            target_passes=1),
              RequestRecord(error="timed out after 600s")]
    return done[:5] + failed + done[5:]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, and bench_serving's)."""
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


def test_summary_of_a_level():
    s = summarize(records(), 8.0, concurrency=4, request_rate=math.inf,
                  server={"accept_sum": 52.0, "accept_count": 20.0, "device_prefill": 0.4,
                          "device_decode": 6.0, "device_idle": 1.2, "width_le_0": 2.0,
                          "width_le_1": 2.0, "width_le_3": 5.0, "width_le_7": 5.0,
                          "width_le_15": 20.0})
    assert (s["concurrency"], s["request_rate"], s["duration_s"]) == (4, "inf", 8.0)
    assert (s["completed"], s["failed"]) == (10, 2)
    assert s["errors"] == ["HTTP 429: busy", "timed out after 600s"]
    assert s["total_input_tokens"] == sum(100 + i for i in range(1, 11)) == 1055
    assert s["total_output_tokens"] == 400
    assert s["request_throughput"] == 10 / 8 and s["output_throughput"] == 400 / 8
    # TTFT 0.1 .. 1.0 s: mean 550 ms, median 550 ms, p99 = 0.9 + 0.91 * 0.1 s
    assert s["mean_ttft_ms"] == pytest.approx(550.0)
    assert s["median_ttft_ms"] == pytest.approx(550.0)
    assert s["p99_ttft_ms"] == pytest.approx(991.0)
    gaps = [g + i for i in range(1, 11) for g in (10, 20, 30)]  # ms
    assert s["mean_itl_ms"] == pytest.approx(sum(gaps) / 30)
    assert s["median_itl_ms"] == pytest.approx(percentile(gaps, 50)) == 25.5
    assert s["p99_itl_ms"] == pytest.approx(percentile(gaps, 99))
    assert s["p99_itl_ms"] == pytest.approx(39.71)  # between 39 and 40 ms
    assert s["mean_e2e_latency_ms"] == pytest.approx(1550.0)
    # 40 tokens, the first from prefill: 39 over 13 passes = 3 per pass.
    assert s["accept_length"] == 3.0
    assert s["accept_length_metrics"] == 2.6
    # the server's device over the 8 s: 75% decoding, 5% prefilling, 15% waiting for the host
    assert (s["device_decode_s"], s["device_prefill_s"], s["device_idle_s"]) == (6.0, 0.4, 1.2)
    assert (s["device_decode_share"], s["device_prefill_share"],
            s["device_idle_share"]) == (0.75, 0.05, 0.15)
    # the widths' cumulative buckets -> passes at each width that ran
    assert s["passes_by_verify_width"] == {"0": 2, "3": 3, "15": 15}


def test_a_level_with_no_finished_request_reports_no_figures():
    s = summarize([RequestRecord(error="HTTP 500: boom")], 2.0, concurrency=1,
                  request_rate=4.0)
    assert (s["completed"], s["failed"], s["request_rate"]) == (0, 1, 4.0)
    assert s["request_throughput"] == 0 and s["total_output_tokens"] == 0
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms",
                "median_itl_ms", "p99_itl_ms", "mean_e2e_latency_ms", "accept_length",
                "accept_length_metrics"):
        assert math.isnan(s[key]), key
