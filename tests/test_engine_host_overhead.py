"""benchmarks/engine_host_overhead.py on the CPU's tiny model: a closed loop over 4 slots
gives AR and DSpine rows whose host spans add up to the host time, and leaves
jax.device_get as it found it."""

from __future__ import annotations

import json

import jax

from dspine_benchmarks import engine_host_overhead

SPANS = ("grow", "admit", "prefill", "decode", "collect", "other")


def test_the_cpu_run_splits_each_step(tmp_path):
    out = tmp_path / "host.json"
    device_get = jax.device_get
    engine_host_overhead.main(["--slots", "4", "--max-tokens", "8", "--warmup-steps", "6",
                               "--steps", "4", "--out", str(out)])
    assert jax.device_get is device_get
    report = json.loads(out.read_text())
    assert report["backend"] == "cpu" and report["target"] == "tiny"
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"ar", "tiny-dspine"}
    for row in rows.values():
        assert row["steps"] >= 1 and row["steps"] + row["compiled_steps"] == 4
        assert row["tokens_per_step"] > 0 and 0 < row["rows"] <= 4
        assert row["device_ms"] > 0 and row["decode_device_ms"] > 0
        host = sum(row[f"{name}_ms"] for name in SPANS)
        assert abs(host - row["host_ms"]) < 1e-3 and row["host_ms"] > 0
        assert abs(row["step_ms"] - row["host_ms"] - row["dispatch_ms"] - row["device_ms"]
                   - row["fetch_ms"]) < 1e-3
    assert rows["ar"]["steps_per_call"] == 8 and rows["tiny-dspine"]["steps_per_call"] == 4
