"""benchmarks/train_throughput.py --profile on the CPU with a tiny target: the trace covers
the steps after the compiling one, its per-step summary adds up, and the kernels are named
by the JAX operations they run (`hlo_names`, from XLA's HLO dump)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dspine_benchmarks.hlo_names import op_names


def test_profiled_run_summarises_the_traced_steps(tiny_llama_dir, tmp_path):
    # A process of its own: XLA reads the dump flag once, before its first compilation.
    out = tmp_path / "tt.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "dspine_benchmarks.train_throughput", "--target",
         str(tiny_llama_dir), "--layers", "1", "--steps", "4", "--batch", "2", "--seq-len",
         "32", "--blocks", "2", "--profile", "6", "--out", str(out)],
        capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    [result] = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["tokens_per_s"] > 0
    profile = result["profile"]
    assert profile["device_us_per_pass"] > 0
    assert 0 < len(profile["top"]) <= 6
    times = [row["us_per_pass"] for row in profile["top"]]
    assert times == sorted(times, reverse=True)
    assert sum(row["share"] for row in profile["top"]) <= 1 + 1e-9
    assert sum(profile["by_kind_us"].values()) == pytest.approx(profile["device_us_per_pass"])
    named = [row["op_name"] for row in profile["top"] if "op_name" in row]
    assert named and all(name.startswith("jit(step)/") for name in named)
    assert "device time per step" in run.stdout


def test_op_names_read_instructions_and_their_kernel_spelling():
    text = """HloModule jit_step
%fused_computation.3 (param_0: f32[4]) -> f32[4] {
  ROOT %exp.1 = f32[4]{0} exponential(%param_0), metadata={op_name="jit(step)/exp"}
}
ENTRY %main (a: bf16[16,64]) -> f32[16,128] {
  %a.1 = bf16[16,64]{1,0} parameter(0), metadata={op_name="a"}
  %gemm_fusion_dot.877 = f32[16,128]{1,0} fusion(%a.1), kind=kCustom, calls=%c, \
metadata={op_name="jit(step)/BnKD,VD->BnKV/dot_general" stack_frame_id=3}
  ROOT %input_reduce_fusion.55 = f32[16]{0} fusion(%gemm_fusion_dot.877), kind=kInput
}"""
    names = op_names(text)
    want = "jit(step)/BnKD,VD->BnKV/dot_general"
    assert names["gemm_fusion_dot.877"] == names["gemm_fusion_dot_877"] == want
    assert names["exp_1"] == "jit(step)/exp"
    assert "input_reduce_fusion_55" not in names  # no metadata: nothing to say


def test_kernel_kinds_name_cublas_hopper_and_xla_top_k_kernels():
    from dspine_benchmarks.train_throughput import kernel_kind

    assert kernel_kind("nvjet_sm90_tss_128x128_64x6_2x1_v_bz_NNT") == "matmul"
    assert kernel_kind("gemm_fusion_dot_862") == "matmul"
    assert kernel_kind("void stream_executor::cuda::Run<16ul, float, unsigned int>"
                       "(float*, int, float*, unsigned int*, int)") == "topk"
    assert kernel_kind("loop_reduce_fusion", "jit(step)/top_k") == "topk"
    assert kernel_kind("loop_transpose_fusion_40", "jit(step)/convert_element_type") == "other"


def test_a_training_config_runs_on_the_target_given(tiny_llama_dir, tmp_path):
    """--config: the config's drafter, loss and batch shape on --target (here a tiny
    checkpoint standing in for the preset a GPU run takes), synthetic data, --set last."""
    config = tmp_path / "c.toml"
    config.write_text('[target]\nname = "not-loaded"\n[drafter]\nkind = "dflash"\nlayers = 1\n'
                      'block_size = 4\nmask_token_id = 1\n[data]\npath = "nowhere"\n'
                      'seq_len = 32\nblocks_per_seq = 2\n[run]\nbatch_size = 4\n')
    out = tmp_path / "tt.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "dspine_benchmarks.train_throughput", "--config", str(config),
         "--target", str(tiny_llama_dir), "--set", "run.batch_size=2", "--steps", "2",
         "--out", str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    [result] = [json.loads(line) for line in out.read_text().splitlines()]
    assert (result["kind"], result["layers"], result["batch"], result["seq_len"],
            result["blocks_per_seq"]) == ("dflash", 1, 2, 32, 2)
    assert result["step_seconds"] == pytest.approx(2 * 32 / result["tokens_per_s"])


def test_config_refuses_the_options_it_replaces(tmp_path):
    from dspine_benchmarks.train_throughput import main

    with pytest.raises(SystemExit) as refused:
        main(["--config", str(tmp_path / "c.toml"), "--kind", "dflash", "--batch", "4"])
    assert refused.value.code == 2
    with pytest.raises(SystemExit):
        main(["--set", "run.batch_size=2"])
