"""Every program lowers for TPU on the CPU (`dspine_benchmarks.lower_for_tpu`: jax.export
with platforms=("tpu",), which runs Pallas's Mosaic TPU lowering), and a block shape the
TPU cannot tile fails there."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from dspine_benchmarks import lower_for_tpu
from pallas_kernels.dspine_proposal.tpu import vocab_top_k_tpu

ROOT = Path(__file__).resolve().parents[1]
SERVING = [f"serve/{method}/{program} T={t}" for method in ("ar", "dflash", "dspine")
           for t in ("0", "0.7") for program in ("prefill", "decode")]
KERNELS = ["kernel/ragged_paged_attention decode T=1", "kernel/ragged_paged_attention verify T=16",
           "kernel/ragged_paged_attention draft T=16",
           "kernel/ragged_paged_attention prefill T=512", "kernel/vocab_top_k R=120 k=16",
           "kernel/lm_head_stats R=1024 forward+backward", "kernel/top_k R=120 k=16 (XLA TopK)"]


def lower_in_a_fresh_process(*args) -> dict[str, str]:
    """Run the command (its 16 CPU devices need a JAX of its own); program -> its line."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, "-m", "dspine_benchmarks.lower_for_tpu", *args],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = {}
    for line in result.stdout.splitlines():
        found = re.match(r"(ok|FAIL) +(\S.*?)(?:  |: |$)", line)
        if found:
            lines[found.group(2).strip()] = line
    return lines


def test_every_program_lowers_for_tpu_at_smollm2_shapes():
    lines = lower_in_a_fresh_process("--target", "preset:smollm2-135m", "--layers", "4",
                                     "--draft-layers", "2")
    expected = SERVING + ["train/dflash mesh 4x4", "train/dspine mesh 4x4"] + KERNELS
    assert sorted(lines) == sorted(expected)
    assert all(line.startswith("ok ") for line in lines.values()), lines
    for name in SERVING:        # the paged attention is the TPU kernel in every program
        assert "ragged_paged_attention x" in lines[name], lines[name]
    for t in ("0", "0.7"):      # DSpine proposes with the TPU kernel; DFlash's draft block
        assert "vocab_top_k x1" in lines[f"serve/dspine/decode T={t}"]   # is bidirectional
        assert "ragged_paged_attention x2" in lines[f"serve/dflash/decode T={t}"]
    assert "lm_head_stats x1" in lines["kernel/lm_head_stats R=1024 forward+backward"]
    assert "mosaic 0" in lines["kernel/top_k R=120 k=16 (XLA TopK)"]
    for kind in ("dflash", "dspine"):
        assert "per device: params" in lines[f"train/{kind} mesh 4x4"]


def mib(line: str, what: str) -> float:
    return float(re.search(rf"{what} ([\d,.]+) MiB", line).group(1).replace(",", ""))


def test_qwen3_8b_training_configs_lower_for_tpu_at_reduced_depth():
    """The Qwen3-8B recipes' training step, Qwen3-8B's width at 4 target layers, on a
    4 x 4 mesh: AdamW holds two moments per parameter, and fsdp splits both."""
    configs = [str(ROOT / "train" / "configs" / f"qwen3_8b_{k}.toml") for k in ("dspine", "dflash")]
    lines = lower_in_a_fresh_process("--target", "preset:qwen3-8b", "--layers", "4", "--only",
                                     "train", "--train-config", *configs)
    for kind in ("dspine", "dflash"):
        line = lines[f"train/qwen3_8b_{kind} mesh 4x4"]
        assert line.startswith("ok "), line
        params, optimizer = mib(line, "params"), mib(line, "optimizer")
        assert optimizer == pytest.approx(2 * params, rel=1e-3)
        # ~1.05 G float32 parameters (5 layers at D 4,096, the fc over 5 features) / 4
        assert 900 < params < 1100, line


def planted(block_r=None, block_v=512) -> lower_for_tpu.Program:
    """vocab_top_k's TPU kernel with a row tile of our choosing."""
    call = functools.partial(vocab_top_k_tpu, k=16, block_r=block_r, block_v=block_v)
    args = (jax.ShapeDtypeStruct((30, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((4096, 256), jnp.bfloat16))
    return lower_for_tpu.Program(f"planted block_r={block_r} block_v={block_v}", call, args)


@pytest.mark.parametrize("block_r,block_v", [(12, 512), (16, 500)])
def test_a_block_shape_the_tpu_cannot_tile_fails_to_lower(block_r, block_v):
    """Rows 12 (not a multiple of 8) or a vocabulary tile of 500 (not of 128): Mosaic's
    lowering refuses it, the command says so and exits 1; the kernel's own tiles lower."""
    bad = lower_for_tpu.lower(planted(block_r, block_v))
    assert bad.error is not None and "divisible by 8 and 128" in bad.error, bad.error
    good = lower_for_tpu.lower(planted())
    assert good.error is None and good.kernels == {"vocab_top_k": 1}
    printed = []
    assert lower_for_tpu.run([planted(), planted(block_r, block_v)], out=printed.append) == 1
    assert printed[0].startswith("ok ") and printed[1].startswith("FAIL ")
    assert printed[-1].startswith("1 of 2 programs") and "failed: planted" in printed[-1]
