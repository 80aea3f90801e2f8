"""benchmarks/serving_summary.py: medians of repeated `dspine bench serve` runs."""

from __future__ import annotations

import json

from dspine_benchmarks import serving_summary


def level(c, tps, failed=0):
    return {"concurrency": c, "output_throughput": tps, "completed": 10 - failed,
            "failed": failed, "median_ttft_ms": tps / 100, "median_itl_ms": 1.0,
            "mean_e2e_latency_ms": 1e5 / tps, "accept_length": 2.0}


def test_median_per_level_and_ratio_to_the_first_server(tmp_path):
    for name, scale in (("ar", 1.0), ("dspine", 1.5)):
        for r, tps in enumerate((100.0, 300.0, 200.0, 250.0, 150.0)):
            run = tmp_path / name / f"c1-run{r}"
            run.mkdir(parents=True)
            (run / "results.json").write_text(json.dumps({"levels": [
                level(1, tps * scale), level(8, 1000 * scale, failed=r == 0)]}))
    serving_summary.main([str(tmp_path / "ar"), str(tmp_path / "dspine"),
                          "--out", str(tmp_path / "s.json")])
    got = json.loads((tmp_path / "s.json").read_text())
    assert got["ar"]["1"]["output_tokens_per_s"] == 200.0
    assert (got["ar"]["1"]["min"], got["ar"]["1"]["max"]) == (100.0, 300.0)
    assert got["dspine"]["1"]["x_first"] == 1.5 and got["dspine"]["8"]["x_first"] == 1.5
    assert got["ar"]["8"]["failed"] == 1 and got["ar"]["8"]["completed"] == 49
    assert got["ar"]["1"]["e2e_mean_ms"] == 500.0          # the median of the runs' means
