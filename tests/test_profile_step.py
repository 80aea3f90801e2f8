"""The profile summary reads the right events out of a Perfetto trace."""

from __future__ import annotations

import pytest

from dspine_benchmarks.profile_step import device_events, summarise


def trace(with_gpu: bool) -> dict:
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}]
    events = [
        {"ph": "X", "pid": 1, "name": "PjitFunction(decode)", "dur": 900},   # a Python frame
        {"ph": "X", "pid": 1, "name": "fusion.3", "dur": 40, "args": {"hlo_op": "fusion.3"}},
    ]
    if with_gpu:
        meta.append({"ph": "M", "name": "process_name", "pid": 7,
                     "args": {"name": "/device:GPU:0"}})
        events += [{"ph": "X", "pid": 7, "name": "ragged_paged_attention", "dur": 30},
                   {"ph": "X", "pid": 7, "name": "gemm_fusion", "dur": 50},
                   {"ph": "X", "pid": 7, "name": "ragged_paged_attention", "dur": 20},
                   {"ph": "i", "pid": 7, "name": "marker"}]
    return {"traceEvents": meta + events}


def test_gpu_kernels_are_summed_per_pass_and_host_frames_ignored():
    summary = summarise(device_events(trace(True)), passes=2, top=5)
    assert summary["device_us_per_pass"] == 50
    assert [(r["op"], r["us_per_pass"]) for r in summary["top"]] == [
        ("ragged_paged_attention", 25), ("gemm_fusion", 25)]
    assert sum(r["share"] for r in summary["top"]) == pytest.approx(1.0)


def test_a_cpu_trace_falls_back_to_xla_op_events():
    summary = summarise(device_events(trace(False)), passes=1, top=5)
    assert [r["op"] for r in summary["top"]] == ["fusion.3"]


def test_the_script_profiles_an_ar_step_and_a_dspine_pass(tiny_llama_dir, tmp_path):
    from dspine_benchmarks.profile_step import main

    out = tmp_path / "profile.json"
    main(["--target", str(tiny_llama_dir), "--methods", "ar", "dspine", "--prompt-len", "8",
          "--calls", "1", "--steps-per-call", "2", "--draft-layers", "1", "--block-size", "4",
          "--dtype", "f32", "--attention-backend", "xla", "--trace-dir", str(tmp_path / "t"),
          "--hlo-out", str(tmp_path / "hlo"), "--out", str(out)])
    import gzip
    import json

    results = json.loads(out.read_text())["results"]
    assert [r["method"] for r in results] == ["ar", "dspine"]
    assert all(r["device_us_per_pass"] > 0 and r["top"] for r in results)
    # the optimised HLO of each method's decode program, with the engine's named scopes
    for method in ("ar", "dspine"):
        with gzip.open(tmp_path / "hlo" / f"{method}.hlo.txt.gz", "rt") as f:
            text = f.read()
        assert "HloModule" in text and "lm_head" in text
    assert "draft" in gzip.open(tmp_path / "hlo" / "dspine.hlo.txt.gz", "rt").read()


def test_profile_step_and_spec_step_share_their_engine_options():
    """One builder: every engine option of spec_step exists in profile_step with the same
    default (spec_step's sweeps take lists: one value per run there)."""
    from dspine_benchmarks import profile_step, spec_step

    sweep, single = vars(spec_step.parse_args([])), vars(profile_step.parse_args([]))
    shared = {"target", "prompt_len", "page_size", "steps_per_call", "calls", "block_size",
              "draft_layers", "dtype", "proposal_kernel"}
    assert shared | {"batch", "context", "attention_backend", "proposal"} <= set(single)
    assert {k: sweep[k] for k in shared} == {k: single[k] for k in shared}
    assert (sweep["attention_backend"], sweep["proposal"]) == (
        [single["attention_backend"]], [single["proposal"]])
    line = ["--proposal", "dense", "--proposal-kernel", "pallas", "--attention-backend", "xla",
            "--context", "64", "--batch", "2"]
    one = profile_step.parse_args(line)
    many = spec_step.parse_args(line)
    assert (one.proposal, one.proposal_kernel, one.context, one.batch) == ("dense", "pallas",
                                                                          64, 2)
    assert (many.proposal, many.attention_backend, many.context, many.batch) == (
        ["dense"], ["xla"], [64], [2])


def test_spec_step_rows_name_the_switches_they_ran_under(tiny_llama_dir, tmp_path,
                                                         monkeypatch):
    """Each row of spec_step carries its decoder's DSPINE_* switches, so before/after
    timings taken in separate processes say which variant each one ran."""
    import json

    from dspine_benchmarks.spec_step import main

    monkeypatch.setenv("DSPINE_TOP_K_SELECT", "topk")
    out = tmp_path / "rows.jsonl"
    main(["--target", str(tiny_llama_dir), "--methods", "ar", "dspine", "--batch", "1",
          "--prompt-len", "8", "--calls", "1", "--steps-per-call", "2", "--draft-layers", "1",
          "--block-size", "4", "--dtype", "f32", "--attention-backend", "xla", "--context",
          "32", "--repeats", "1", "--no-stages", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["method"] for r in rows] == ["ar", "dspine"]
    assert all(r["step_ms"] > 0 for r in rows)
    assert all(r["switches"]["top_k_select"] == "topk" and r["switches"]["rpa_packed"]
               for r in rows)
