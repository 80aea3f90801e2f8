"""Benchmark prompts from the packages, and `dspine eval` end to end on a tiny target."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dspine_cli.main import app
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
    # Speedup: each method's tokens/s (tokens over decode seconds) over AR's; one
    # benchmark, so the mean row is that benchmark's row.
    ar_rate = row["ar"]["tokens"] / row["ar"]["seconds"]
    for label, result in row.items():
        rate = result["tokens"] / result["seconds"]
        assert result["tokens_per_second"] == pytest.approx(rate, rel=1e-12)
        assert result["speedup"] == pytest.approx(rate / ar_rate, rel=1e-12)
        for key in ("accept_length", "tokens_per_second", "speedup"):
            assert report["mean"][label][key] == pytest.approx(result[key], rel=1e-12)
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


# (tokens, decode seconds, tau) per benchmark and method: AR at 100-140 tokens/s.
SYNTHETIC = {"math500": {"ar": (640, 6.4, 1.0), "dflash": (640, 3.2, 2.5),
                         "dspine": (640, 2.0, 3.5)},
             "humaneval": {"ar": (512, 4.0, 1.0), "dflash": (512, 4.0, 1.5),
                           "dspine": (512, 1.6, 4.0)},
             "mtbench": {"ar": (300, 2.5, 1.0), "dflash": (300, 3.0, 1.2),
                         "dspine": (300, 2.0, 2.0)}}


def test_eval_mean_row_and_speedups_recompute(tiny_llama_dir, tiny_dspine_dir, tmp_path,
                                              monkeypatch):
    """The mean row and every speedup against values recomputed from the per-benchmark
    results: speedup = tokens/s over AR's on the same benchmark; the mean row averages
    each benchmark's tau, tokens/s and speedup (unweighted, as the papers report)."""
    from dspine_jax.evaluation import run

    made = CliRunner().invoke(app, ["init-drafter", "--target", str(tiny_llama_dir), "--kind",
                                    "dflash", "--layers", "1", "--block-size", "4",
                                    "--mask-token-id", "5", "--out", str(tmp_path / "dflash")])
    assert made.exit_code == 0, made.output
    order = iter(SYNTHETIC)

    def fake_benchmark(pipes, prompts, **options):
        numbers = SYNTHETIC[next(order)]
        assert set(pipes) == set(numbers)
        return {label: {"prompts": 4, "skipped_too_long": 0, "tokens": t, "seconds": sec,
                        "compile_seconds": 0.0, "tokens_per_second": t / sec,
                        "accept_length": tau}
                for label, (t, sec, tau) in numbers.items()}

    monkeypatch.setattr(run, "run_benchmark", fake_benchmark)
    report = run.evaluate(str(tiny_llama_dir), [str(tmp_path / "dflash"), str(tiny_dspine_dir)],
                          list(SYNTHETIC), tmp_path / "eval", limit=4)
    assert report == json.loads((tmp_path / "eval" / "results.json").read_text())
    for name, numbers in SYNTHETIC.items():
        ar_tokens, ar_seconds, _ = numbers["ar"]
        for label, (tokens, seconds, _) in numbers.items():
            want = (tokens / seconds) / (ar_tokens / ar_seconds)
            assert report["benchmarks"][name][label]["speedup"] == pytest.approx(want)
    assert report["benchmarks"]["humaneval"]["dspine"]["speedup"] == pytest.approx(2.5)
    means = {label: {"accept_length": sum(SYNTHETIC[b][label][2] for b in SYNTHETIC) / 3,
                     "tokens_per_second": sum(SYNTHETIC[b][label][0] / SYNTHETIC[b][label][1]
                                              for b in SYNTHETIC) / 3,
                     "speedup": sum(report["benchmarks"][b][label]["speedup"]
                                    for b in SYNTHETIC) / 3}
             for label in ("ar", "dflash", "dspine")}
    assert report["mean"].keys() == means.keys()
    for label, want in means.items():
        for key, value in want.items():
            assert report["mean"][label][key] == pytest.approx(value), (label, key)
    # dspine: tau (3.5 + 4 + 2) / 3, tokens/s (320 + 320 + 150) / 3, speedup (3.2 + 2.5 + 1.25) / 3
    dspine = report["mean"]["dspine"]
    assert (round(dspine["accept_length"], 4), round(dspine["tokens_per_second"], 4),
            round(dspine["speedup"], 4)) == (3.1667, 263.3333, 2.3167)
    mean_line = [line for line in (tmp_path / "eval" / "results.md").read_text().splitlines()
                 if line.startswith("| **mean** |")]
    # AR 100, 128, 120 tokens/s; DFlash 200, 128, 100 (speedups 2, 1, 0.83)
    assert mean_line == ["| **mean** | 1.00 | 116.0 | 1.00x | 1.73 | 142.7 | 1.28x | "
                         "3.17 | 263.3 | 2.32x |"]

