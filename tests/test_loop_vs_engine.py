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
                         "--stream-ahead", "0", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["side"], r["method"], r["stream_ahead"]) for r in rows] == [
        ("jax", "ar", 0), ("jax", "ar", 1), ("jax", "d", 0), ("jax", "d", 1)]
    ar, _, spec, spec_ahead = rows
    # batches of 2 and 1 rows, 6 tokens each: 5 decode steps per batch after the prefill
    assert ar["batch_passes"] == 10 and ar["row_pass_share"] == 1.0 and ar["tau"] == 1.0
    assert 0 < spec["batch_passes"] <= 10 and 0 < spec["row_pass_share"] <= 1.0
    # the same greedy passes whether the next call is queued ahead of the host or not
    assert spec_ahead["batch_passes"] == spec["batch_passes"]
    assert spec_ahead["tau"] == spec["tau"]
    for r in rows:
        assert r["tokens"] == 18 and 0 < r["prefill_seconds"] < r["seconds"]
        assert r["pass_ms"] > 0 and r["first_run_seconds"] > 0


def test_compile_shapes_prepares_one_group_per_shape():
    """Groups that the decoder buckets alike compile once; each distinct (rows, padded
    prompt, capacity) shape once, with the run's options."""
    import threading

    from dspine_benchmarks.loop_vs_engine import compile_shapes
    from dspine_jax.decoding import BatchDecoder

    calls, lock = [], threading.Lock()

    class Decoder:
        extra_capacity = 16
        config = type("Config", (), {"max_position_embeddings": 8192})
        bucket_shape = BatchDecoder.bucket_shape

        def prepare(self, group, **options):
            with lock:
                calls.append((len(group), max(len(p) for p in group), options))

    groups = [[[1] * 20], [[1] * 30], [[1] * 40], [[1] * 20, [1] * 5], [[1] * 300]]
    compile_shapes(Decoder(), groups, 4, max_new_tokens=100, ignore_eos=True)
    # 20 and 30 tokens share a 32-token bucket; 40 pads to 64; two rows; 300 to 512
    assert sorted(c[:2] for c in calls) == [(1, 20), (1, 40), (1, 300), (2, 20)]
    assert all(c[2] == {"max_new_tokens": 100, "ignore_eos": True} for c in calls)
