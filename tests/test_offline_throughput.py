"""benchmarks/offline_throughput.py on the CPU with a tiny target: both engines emit every
row's tokens, agree on tau at T = 0 (the same greedy passes), and count the straggler
cost of static batches."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dspine_benchmarks import offline_throughput
from dspine_cli.main import app
from dspine_jax.speculative.policy import expected_tokens


def test_rows_of_both_engines(tiny_llama_dir, tmp_path):
    made = CliRunner().invoke(app, [
        "init-drafter", "--target", str(tiny_llama_dir), "--kind", "dspine", "--layers", "1",
        "--block-size", "4", "--mask-token-id", "5", "--out", str(tmp_path / "d")])
    assert made.exit_code == 0, made.output
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"the quick brown fox {i}" * (1 + i % 3)})
                               + "\n" for i in range(5)))
    out = tmp_path / "ot.json"
    offline_throughput.main([
        "--target", str(tiny_llama_dir), "--drafter", str(tmp_path / "d"), "--prompts",
        str(prompts), "--num-prompts", "5", "--rows", "2", "--max-new-tokens", "10",
        "--dtype", "f32", "--speculation", "fixed", "--repeats", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["engine"]) for r in rows] == [
        ("ar", "batch"), ("ar", "slots"), ("d", "batch"), ("d", "slots")]
    ar_batch, ar_slots, batch, slots = rows
    for r in rows:
        assert r["tokens"] == 50 and r["tokens_per_s"] > 0 and r["x_ar_best"] > 0
    # AR: 9 passes per row after the prefill, every row in step
    assert ar_batch["row_passes"] == ar_slots["row_passes"] == 45
    assert ar_batch["row_pass_share"] == 1.0 and ar_batch["tau"] == ar_slots["tau"] == 1.0
    assert ar_batch["x_ar"] == ar_slots["x_ar"] == 1.0
    # greedy: the same passes per row whichever engine decodes it
    assert batch["row_passes"] == slots["row_passes"] and batch["tau"] == slots["tau"]
    assert batch["batch_passes"] * 2 >= batch["row_passes"] and batch["row_pass_share"] <= 1
    assert slots["steps"] > 0 and slots["preemptions"] == 0
    # static batches: the median of the timed runs, and the drafter's per-slot profile
    # (every pass verified the whole block of 3 drafts) gives back its tau
    assert len(ar_batch["seconds_runs"]) == len(batch["seconds_runs"]) == 2
    # every drafter pass at the whole block of 3 drafts, counted by either engine; an AR
    # step is a pass of width 0
    assert batch["verify_widths"] == {"3": batch["row_passes"]}
    assert slots["verify_widths"] == {"3": slots["row_passes"]}
    assert ar_batch["verify_widths"] == ar_slots["verify_widths"] == {"0": 45}
    assert expected_tokens(batch["acceptance_profile"], 3) == pytest.approx(batch["tau"],
                                                                           abs=2e-3)
    # float32 at T = 0: every engine emits AR's own tokens
    assert [r["same_as_ar"] for r in rows] == [1.0] * 4
