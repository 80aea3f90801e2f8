"""benchmarks/loop_vs_engine.py --skip-torch on the CPU with a tiny target: the JAX rows
split the engine's time into prefill and decode passes, and count those passes as the
engine's own accept lengths do."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from dspine_benchmarks import loop_vs_engine
from dspine_cli.main import app


def test_jax_rows_split_prefill_and_passes(tiny_llama_dir, tmp_path):
    made = CliRunner().invoke(app, [
        "init-drafter", "--target", str(tiny_llama_dir), "--kind", "dspine", "--layers", "1",
        "--block-size", "4", "--mask-token-id", "5", "--out", str(tmp_path / "d")])
    assert made.exit_code == 0, made.output
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"the quick brown fox {i}"}) + "\n"
                               for i in range(3)))
    out = tmp_path / "lve.json"
    loop_vs_engine.main(["--target", str(tiny_llama_dir), "--drafter", str(tmp_path / "d"),
                         "--prompts", str(prompts), "--num-prompts", "3", "--batch", "2",
                         "--max-new-tokens", "6", "--dtype", "f32", "--skip-torch",
                         "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["side"], r["method"]) for r in rows] == [("jax", "ar"), ("jax", "d")]
    ar, spec = rows
    # batches of 2 and 1 rows, 6 tokens each: 5 decode steps per batch after the prefill
    assert ar["batch_passes"] == 10 and ar["row_pass_share"] == 1.0 and ar["tau"] == 1.0
    assert 0 < spec["batch_passes"] <= 10 and 0 < spec["row_pass_share"] <= 1.0
    for r in rows:
        assert r["tokens"] == 18 and 0 < r["prefill_seconds"] < r["seconds"]
        assert r["pass_ms"] > 0 and r["first_run_seconds"] > 0
