"""benchmarks/train_throughput.py --profile on the CPU with a tiny target: the trace covers
the steps after the compiling one, and its per-step summary adds up."""

from __future__ import annotations

import json

import pytest

from dspine_benchmarks import train_throughput


def test_profiled_run_summarises_the_traced_steps(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "tt.jsonl"
    train_throughput.main(["--target", str(tiny_llama_dir), "--layers", "1", "--steps", "4",
                           "--batch", "2", "--seq-len", "32", "--blocks", "2",
                           "--profile", "5", "--out", str(out)])
    [result] = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["tokens_per_s"] > 0
    profile = result["profile"]
    assert profile["device_us_per_pass"] > 0
    assert 0 < len(profile["top"]) <= 5
    times = [row["us_per_pass"] for row in profile["top"]]
    assert times == sorted(times, reverse=True)
    assert sum(row["share"] for row in profile["top"]) <= 1 + 1e-9
    assert sum(profile["by_kind_us"].values()) == pytest.approx(profile["device_us_per_pass"])
    assert "device time per step" in capsys.readouterr().out
