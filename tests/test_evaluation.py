"""Benchmark prompts from the packages, and `dspine eval` end to end on a tiny target."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dspine_jax.cli import app
from dspine_jax.evaluation.benchmarks import BENCHMARKS, load_benchmark


@pytest.mark.parametrize("name,count", [("math500", 311), ("aime24", 30), ("aime25", 15),
                                        ("cnmo", 18), ("humaneval", 164), ("mtbench", 80)])
def test_benchmark_sizes(name, count):
    prompts = load_benchmark(name)
    assert len(prompts) == count
    assert all(p["prompt"].strip() and p["chat"] for p in prompts)
    assert len({p["id"] for p in prompts}) == count


def test_humaneval_prompt_keeps_the_signature():
    first = load_benchmark("humaneval")[0]
    assert first["id"] == "HumanEval/0" and "def has_close_elements(" in first["prompt"]


def test_unknown_benchmark_is_named(tiny_llama_dir, tmp_path):
    result = CliRunner().invoke(app, ["eval", "--target", str(tiny_llama_dir), "--benchmarks",
                                      "gsm8k", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown benchmark(s) ['gsm8k']" in result.output
    assert set(BENCHMARKS) >= {"math500", "sharegpt"}


def test_eval_reports_every_method(tiny_llama_dir, tmp_path):
    runner = CliRunner()
    for kind in ("dflash", "dspine"):
        made = runner.invoke(app, ["init-drafter", "--target", str(tiny_llama_dir), "--kind",
                                   kind, "--layers", "1", "--block-size", "4",
                                   "--mask-token-id", "5", "--out", str(tmp_path / kind)])
        assert made.exit_code == 0, made.output
    result = runner.invoke(app, [
        "eval", "--target", str(tiny_llama_dir), "--drafter", str(tmp_path / "dflash"),
        "--drafter", str(tmp_path / "dspine"), "--benchmarks", "mtbench", "--limit", "3",
        "--max-new-tokens", "10", "--batch-size", "2", "--out", str(tmp_path / "eval")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "eval" / "results.json").read_text())
    row = report["benchmarks"]["mtbench"]
    assert set(row) == {"ar", "dflash", "dspine"}
    assert row["ar"]["accept_length"] == 1.0 and row["ar"]["speedup"] == 1.0
    # Lossless decoding: every method generates exactly the same number of tokens.
    assert row["ar"]["tokens"] == row["dflash"]["tokens"] == row["dspine"]["tokens"] > 0
    assert all(1.0 <= r["accept_length"] <= 4 for r in row.values())
    assert "| mtbench |" in (tmp_path / "eval" / "results.md").read_text()
    assert (tmp_path / "eval" / "acceptance.png").stat().st_size > 10_000

    # A second run into the same folder is refused and leaves the first run's results.
    before = (tmp_path / "eval" / "results.json").read_bytes()
    again = runner.invoke(app, ["eval", "--target", str(tiny_llama_dir), "--benchmarks",
                                "mtbench", "--limit", "1", "--out", str(tmp_path / "eval")])
    assert again.exit_code == 2
    assert "already holds results of an earlier run" in again.output
    assert (tmp_path / "eval" / "results.json").read_bytes() == before


def test_drafter_columns_are_unambiguous():
    from dspine_jax.evaluation.run import drafter_labels

    # One drafter per kind: the kind alone.
    assert drafter_labels(["dflash", "dspine"], ["runs/a/drafter", "smollm2-x-dspine"]) == \
        ["dflash", "dspine"]
    # Two of a kind: both carry their run name (the first used to be labelled by kind only,
    # which hid which run it was).
    assert drafter_labels(["dspine", "dspine", "dflash"],
                          ["runs/smollm2-dspine-no-chain/drafter", "runs/abl/drafter",
                           "runs/d/drafter"]) == \
        ["dspine:smollm2-dspine-no-chain", "dspine:abl", "dflash"]
    # The bf16 exports of train/ship_smollm2.sh are named by their run too.
    bf16 = ["runs/ablate-dspine-ce/drafter-bf16", "runs/ablate-dspine-no-alignment/drafter-bf16"]
    assert drafter_labels(["dspine", "dspine"], bf16) == \
        ["dspine:ablate-dspine-ce", "dspine:ablate-dspine-no-alignment"]
    # The same run twice still gives two columns.
    assert drafter_labels(["dspine", "dspine"], ["r/drafter", "r/drafter"]) == \
        ["dspine:r", "dspine:r'"]
