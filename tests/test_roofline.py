"""The roofline table's bytes, FLOPs and groups, against hand-counted HLO and the model's
own shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspine_benchmarks import hlo_names, roofline

# a hand-written module: a dot fusion, an in-place update fusion and a cuBLAS gemm call
HLO = (Path(__file__).parent / "fixtures" / "roofline_module.hlo.txt").read_text()


def test_bytes_and_flops_of_each_kernel_are_counted_by_hand():
    costs = roofline.hlo_costs(HLO)
    # a dot fusion: reads both operands, writes its result; 2 x M x N x K FLOPs
    gemm = costs["gemm_fusion_dot_1"]          # the GPU kernel's spelling
    assert gemm == costs["gemm_fusion_dot.1"]
    assert (gemm.bytes, gemm.flops) == (4 * 16 * 4 + 4 * 8 * 2 + 16 * 8 * 2, 2 * 4 * 16 * 8)
    # an in-place update moves its update and index (read and written), not the buffer
    assert costs["dus_fusion"].bytes == 2 * (1 * 8 * 4 + 4) and costs["dus_fusion"].flops == 0
    # a cuBLAS gemm: K from its backend config; its result tuple holds the workspace
    cublas = costs["custom-call.3"]
    assert cublas.flops == 2 * 4 * 16 * 8
    assert cublas.bytes == (4 * 16 * 4 + 1024) + 4 * 8 * 2 + 16 * 8 * 2
    assert "Arg_0.1" not in costs and "tuple" not in costs     # no kernels


def test_a_fusion_without_metadata_takes_its_body_op_name():
    names = hlo_names.op_names(HLO)
    assert names["gemm_fusion_dot_1"].endswith("/mlp/...i,oi->...o/dot_general")
    assert names["dus_fusion"].endswith("/attention/scatter")
    assert names["custom-call.3"].endswith("/lm_head/dot_general")


@pytest.mark.parametrize("op_name, kernel, group", [
    ("jit(decode_rows)/while/body/draft/qkv/dot_general", "", "draft"),
    ("jit(decode_rows)/while/body/mlp/...i,oi->...o/dot_general", "", "mlp"),
    ("jit(decode_rows)/while/body/proposal/jit(_vocab_top_k)/top_k", "", "proposal"),
    ("jit(decode_rows)/while/body/accept/draft/dot_general", "", "draft"),
    ("", "ragged_paged_attention_kernel", "attention"),
    ("jit(decode_rows)/while/body/add", "loop_add_fusion", "other")])
def test_groups_come_from_the_named_scopes(op_name, kernel, group):
    assert roofline.group_of(op_name, kernel) == group


def test_group_rows_put_each_group_against_the_measured_peaks():
    costs = {"a": roofline.Cost(bytes=2e6, flops=1e6), "b": roofline.Cost(bytes=0, flops=4e9),
             "while.1": roofline.Cost(container=True)}
    names = {"a": "x/mlp/dot", "b": "x/lm_head/dot"}
    events = [{"name": "a", "dur": 100.0}, {"name": "a", "dur": 100.0},
              {"name": "b", "dur": 200.0}, {"name": "while.1", "dur": 999.0}]
    peaks = {"copy_gb_s": 100.0, "matmul_tflop_s": 10.0}
    rows = {r["group"]: r for r in roofline.group_rows(events, 2, names, costs, peaks)}
    assert set(rows) == {"mlp", "lm_head"}            # the loop's span is not a kernel
    mlp, head = rows["mlp"], rows["lm_head"]
    assert mlp["us_per_pass"] == 100 and mlp["bytes_per_pass"] == 2e6
    assert mlp["gb_s"] == pytest.approx(20.0) and mlp["bandwidth_share"] == pytest.approx(0.2)
    assert mlp["floor_us"] == pytest.approx(20.0) and mlp["x_floor"] == pytest.approx(5.0)
    # one 200 us kernel of 4 GFLOP over two passes: 2 GFLOP in 100 us per pass
    assert head["flops_per_pass"] == 2e9 and head["tflop_s"] == pytest.approx(20.0)
    assert head["floor_us"] == pytest.approx(200.0) and head["x_floor"] == pytest.approx(0.5)
    override = roofline.group_rows(events, 2, names, costs, peaks, {"mlp": 5e5})
    assert override[0]["bytes_per_pass"] == 5e5


def test_library_kernels_are_named_after_their_hlo_instruction():
    """A cuBLAS kernel in a GPU trace is named after itself; its custom call (with its
    op_name and costs) is the event's hlo_op: grouped by that, not as 'other'."""
    names = {"custom-call.7": "jit(decode_rows)/while/body/mlp/dot_general",
             "gemm_fusion_dot.1": "jit(decode_rows)/while/body/qkv/dot_general"}
    costs = {"custom-call.7": roofline.Cost(bytes=4e6, flops=2e9)}
    events = [{"name": "nvjet_sm90_tss_96x128_64x7_2x1_v_bz_TNN", "dur": 50.0,
               "args": {"hlo_op": "custom-call.7"}},
              {"name": "gemm_fusion_dot.1", "dur": 10.0, "args": {"hlo_op": "fusion.3"}},
              {"name": "memcpy32_post", "dur": 1.0}]
    # a kernel shared by identical fusions is named after the first: hlo_op says which
    # one it ran for
    names["gemm_fusion_dot.9"] = "jit(decode_rows)/while/body/mlp/dot_general"
    events.append({"name": "gemm_fusion_dot_1", "dur": 30.0,
                   "args": {"hlo_op": "gemm_fusion_dot.9"}})
    resolved = roofline.resolve_kernel_names(events, set(names) | set(costs))
    assert [e["name"] for e in resolved] == ["custom-call.7", "gemm_fusion_dot.1",
                                             "memcpy32_post", "gemm_fusion_dot.9"]
    peaks = {"copy_gb_s": 100.0, "matmul_tflop_s": 10.0}
    rows = {r["group"]: r for r in roofline.group_rows(resolved, 1, names, costs, peaks)}
    assert rows["mlp"]["us_per_pass"] == 80 and rows["mlp"]["flops_per_pass"] == 2e9
    assert rows["qkv"]["us_per_pass"] == 10 and "other" in rows


# A scheduled loop body: fusions and cuBLAS calls in the order they run.
SCHEDULED = (Path(__file__).parent / "fixtures" / "scheduled_module.hlo.txt").read_text()


def test_library_kernels_in_a_cuda_graph_are_placed_by_the_schedule():
    """In a CUDA graph a cuBLAS kernel's event names the command buffer: the run of library
    kernels between two scheduled fusions takes the library calls scheduled between them,
    in order, and a call that launched two kernels takes both. A kernel that ran more than
    once a pass (shared by identical fusions) is no anchor."""
    schedule = roofline.hlo_schedule([SCHEDULED])
    assert schedule.library_calls == {"body": [(2, "custom-call.2"), (4, "custom-call.4"),
                                               (6, "custom-call.6")]}
    graph = {"hlo_op": "command_buffer_9"}
    kernels = [("norm_fusion_1", {}), ("nvjet_sm90_a", graph), ("nvjet_sm90_b", graph),
               ("add_fusion_5", {}), ("nvjet_sm90_c", graph), ("cutlass_splitk_reduce", graph),
               ("Memset 0", graph), ("out_fusion_8", {}),
               ("nvjet_sm90_a", graph)]            # after the last scheduled kernel
    events = [{"name": name, "ts": float(ts), "dur": 1.0, "pid": 1, "tid": 7, "args": args}
              for ts, (name, args) in enumerate(kernels)]
    events = [events[i] for i in (3, 0, 2, 1, 8, 5, 4, 7, 6)]   # any order: sorted by ts
    known = set(roofline.hlo_costs(SCHEDULED))
    resolved = sorted(roofline.resolve_kernel_names(events, known, schedule),
                      key=lambda e: e["ts"])
    assert [e["name"] for e in resolved] == [
        "norm_fusion_1", "custom-call.2", "custom-call.4", "add_fusion_5", "custom-call.6",
        "custom-call.6", "Memset 0", "out_fusion_8", "nvjet_sm90_a"]
    assert resolved[1]["kernel"] == "nvjet_sm90_a"
    # add_fusion_5's kernel also ran for another fusion (a later layer's): only the
    # calls after the last anchor before it, and up to the next one, are placed
    shared = events + [{"name": "add_fusion_5", "ts": 9.0, "dur": 1.0, "pid": 1, "tid": 7,
                        "args": {}}]
    resolved = sorted(roofline.resolve_kernel_names(shared, known, schedule),
                      key=lambda e: e["ts"])
    assert [e["name"] for e in resolved][:6] == [
        "norm_fusion_1", "nvjet_sm90_a", "nvjet_sm90_b", "add_fusion_5", "nvjet_sm90_c",
        "cutlass_splitk_reduce"]
    # two passes in the trace: kernels that ran twice are anchors
    twice = events + [{**e, "ts": e["ts"] + 100} for e in events]
    resolved = roofline.resolve_kernel_names(twice, known, schedule, passes=2)
    assert sum(e["name"] == "custom-call.6" for e in resolved) == 4
    # what stays unplaced is a GEMM all the same
    assert roofline.group_of("", "nvjet_sm90_a") == "gemm"


def test_profile_step_counts_the_models_gemm_flops(tiny_llama_dir, tmp_path):
    """A DSpine pass's named GEMMs: each group's FLOPs per pass are what the model's shapes
    give (2 x tokens x in x out per weight), not a multiple of it."""
    import json

    from dspine_benchmarks.profile_step import main

    out = tmp_path / "profile.json"
    block = 4
    main(["--target", str(tiny_llama_dir), "--methods", "dspine", "--prompt-len", "8",
          "--calls", "1", "--steps-per-call", "2", "--draft-layers", "1", "--block-size",
          str(block), "--dtype", "f32", "--attention-backend", "xla",
          "--trace-dir", str(tmp_path / "t"), "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["peaks"]["copy_gb_s"] > 0 and report["peaks"]["matmul_tflop_s"] > 0
    groups = {g["group"]: g for g in report["results"][0]["groups"]}
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    d, i = config["hidden_size"], config["intermediate_size"]
    layers = config["num_hidden_layers"]
    mlp = 2 * block * layers * 3 * d * i            # the verify forward over the block
    assert groups["mlp"]["flops_per_pass"] == pytest.approx(mlp)
    assert groups["draft"]["flops_per_pass"] > 0 and groups["proposal"]["flops_per_pass"] > 0


def test_no_cuda_graphs_adds_the_flag_once_and_keeps_the_others():
    from dspine_benchmarks.profile_step import NO_COMMAND_BUFFERS, without_cuda_graphs

    environ = {"XLA_FLAGS": "--xla_dump_to=/d"}
    without_cuda_graphs(environ)
    without_cuda_graphs(environ)
    assert environ["XLA_FLAGS"].split() == ["--xla_dump_to=/d", NO_COMMAND_BUFFERS]
    empty = {}
    without_cuda_graphs(empty)
    assert empty == {"XLA_FLAGS": NO_COMMAND_BUFFERS}
