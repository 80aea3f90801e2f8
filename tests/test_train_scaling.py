"""benchmarks/train_scaling.py: the figures it reports from the trainers' metrics."""

from __future__ import annotations

import math

import pytest

from dspine_benchmarks.train_scaling import first_step_parity, parse_mesh, summarise


def run(data, fsdp, losses, tokens_per_s, ce=None):
    rows = [{"step": str(10 * (i + 1)), "loss": str(loss), "tokens_per_s": str(tps),
             "mfu": "", "backbone_ce": str(ce if ce is not None else loss * 2)}
            for i, (loss, tps) in enumerate(zip(losses, tokens_per_s))]
    return {"mesh": f"{data}x{fsdp}", "devices": data * fsdp, "rows": rows,
            "wall_s": 1.0, "peak_device_memory_bytes": 2 ** 30}


def test_efficiency_leaves_out_the_compiling_window():
    one = run(1, 1, [4.0, 3.0, 2.0], [10.0, 100.0, 100.0])     # first window compiles
    two = run(2, 1, [4.0, 3.3, 2.0], [5.0, 180.0, 180.0])
    ref, dp = summarise([one, two])
    assert ref["tokens_per_s"] == 100.0 and ref["efficiency"] == 1.0
    assert dp["speedup"] == pytest.approx(1.8) and dp["efficiency"] == pytest.approx(0.9)
    assert dp["max_rel_loss_gap"] == pytest.approx(0.1)
    assert dp["mean_rel_loss_gap"] == pytest.approx(0.1 / 3)
    assert dp["peak_device_memory_gib"] == 1.0 and not dp["nan_loss"]


def test_a_nan_loss_is_never_a_small_gap():
    one = run(1, 1, [4.0, 3.0], [10.0, 100.0])
    broken = run(2, 1, [4.0, float("nan")], [10.0, 190.0])
    result = summarise([one, broken])[1]
    assert result["nan_loss"] and math.isnan(result["max_rel_loss_gap"])
    parity = {r["metric"]: r["2x1"] for r in first_step_parity([one, broken])}
    assert parity == {"loss": 0.0, "backbone_ce": 0.0}


def test_first_step_parity_names_the_metric_that_differs():
    one = run(1, 1, [4.0], [10.0], ce=8.0)
    fsdp = run(1, 2, [4.0], [10.0], ce=6.0)
    parity = {r["metric"]: r["1x2"] for r in first_step_parity([one, fsdp])}
    assert parity["loss"] == 0.0 and parity["backbone_ce"] == pytest.approx(0.25)


@pytest.mark.parametrize("text", ["2", "0x1", "axb", "2x"])
def test_bad_mesh_is_refused(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="mesh"):
        parse_mesh(text)
