"""pallas_kernels.split_k_matmul against float64 numpy (interpret mode on the CPU): rows
that fill no tile, every split count, bfloat16 and float32; its default tiling; bad
shapes named; the CUDA lowering; and (`gpu`) the compiled kernel at Qwen3-8B's verify
shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.split_k_matmul import Tiling, check_shapes, default_tiling, split_k_matmul


def _operands(m, n, k, dtype, seed=0):
    x = jax.random.normal(jax.random.key(seed), (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(jax.random.key(seed + 1), (n, k), jnp.float32) * 0.05).astype(dtype)
    return x, w


def _f64_product(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


@pytest.mark.parametrize("rows", [1, 5, 16, 23])
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_matches_float64_at_every_split(rows, splits):
    x, w = _operands(rows, 64, 256, jnp.float32)
    got = split_k_matmul(x, w, Tiling(block_n=32, block_k=32, splits=splits), interpret=True)
    assert got.shape == (rows, 64) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got, np.float64), _f64_product(x, w),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 4])
def test_bf16_rounds_once_from_a_float32_sum(splits):
    """bfloat16 operands: the float32 sum is rounded once to bfloat16, so each entry is
    within one bf16 step of the float64 product (the splits' float32 partials do not
    round to bf16 on the way)."""
    x, w = _operands(20, 128, 512, jnp.bfloat16, seed=3)
    got = split_k_matmul(x, w, Tiling(block_n=64, block_k=64, splits=splits), interpret=True)
    assert got.dtype == jnp.bfloat16
    want = _f64_product(x, w)
    step = np.abs(want) * float(jnp.finfo(jnp.bfloat16).eps)
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= step + 1e-6)


def test_default_tiling_fills_the_multiprocessors_with_long_programs():
    """Qwen3-8B's verify at batch 8 (128 rows) on 132 multiprocessors: a 4,096-wide output
    (32 tiles) splits its input 8 ways where each slice keeps >= 16 chunks; the 24,576-wide
    gate/up (192 tiles) already fills the GPU and does not split."""
    assert default_tiling(128, 6144, 4096, 132) == Tiling(block_n=128, block_k=64, splits=4)
    assert default_tiling(128, 4096, 12288, 132).splits == 8
    assert default_tiling(128, 4096, 4096, 132).splits == 4          # 64 chunks: 16 each
    assert default_tiling(128, 24576, 4096, 132).splits == 1
    assert default_tiling(256, 4096, 4096, 132).block_n == 64
    for m, n, k in [(128, 6144, 4096), (16, 4096, 12288), (256, 24576, 4096)]:
        t = default_tiling(m, n, k, 132)
        check_shapes(m, n, k, t)
        assert k // (t.block_k * t.splits) >= 16


def test_bad_shapes_are_named():
    x, w = _operands(4, 64, 96, jnp.float32)
    with pytest.raises(ValueError, match="does not split into 2 slices"):
        split_k_matmul(x, w, Tiling(block_n=32, block_k=32, splits=2), interpret=True)
    with pytest.raises(ValueError, match="not a multiple of block_n"):
        split_k_matmul(x, w, Tiling(block_n=128, block_k=32), interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        split_k_matmul(x, w, Tiling(block_n=48, block_k=32), interpret=True)
    with pytest.raises(ValueError, match="1 to 256 rows"):
        big, _ = _operands(300, 64, 96, jnp.float32)
        split_k_matmul(big, w, Tiling(block_n=32, block_k=32), interpret=True)
    with pytest.raises(ValueError, match="x is"):
        split_k_matmul(x, w[:, :64], Tiling(block_n=32, block_k=32), interpret=True)


def test_lowers_for_cuda():
    """The kernel lowers to Triton for a CUDA GPU from this CPU at Qwen3-8B's q/k/v shape."""
    spec = jax.ShapeDtypeStruct
    text = (jax.jit(lambda x, w: split_k_matmul(x, w))
            .trace(spec((128, 4096), jnp.bfloat16), spec((6144, 4096), jnp.bfloat16))
            .lower(lowering_platforms=("cuda",)).as_text())
    assert "triton" in text and "split_k_matmul" in text


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [16, 128, 256])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288)])
def test_gpu_kernel_matches_float64(rows, n, k):
    x, w = _operands(rows, n, k, jnp.bfloat16, seed=rows)
    got = np.asarray(split_k_matmul(x, w), np.float64)
    want = _f64_product(x, w)
    step = np.abs(want) * float(jnp.finfo(jnp.bfloat16).eps)
    assert np.all(np.abs(got - want) <= step + 1e-3)


def test_the_verify_gemm_switch_runs_the_kernel_for_verify_rows(monkeypatch):
    """layers.project under verify_gemm="pallas" (a CUDA backend pretended, the kernel
    interpreted): 16 to 256 rows go through split_k_matmul and match float64; fewer rows,
    and every product without the switch, stay XLA's einsum."""
    from dspine_jax import layers
    from pallas_kernels import split_k_matmul as module
    from pallas_kernels.switches import Switches

    calls = []
    real = module.split_k_matmul

    def interpreted(x, w, tiling=None, interpret=False):
        calls.append(x.shape)
        return real(x, w, tiling, interpret=True)

    monkeypatch.setattr(module, "split_k_matmul", interpreted)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x, w = _operands(32, 256, 128, jnp.float32)
    x = x.reshape(2, 16, 128)
    with Switches(verify_gemm="pallas").active():
        verify = layers.project(x, w)
        step = layers.project(x[:, :4], w)
    plain = layers.project(x, w)
    assert calls == [(32, 128)]
    want = _f64_product(x.reshape(32, 128), w).reshape(2, 16, 256)
    for got, ref in ((verify, want), (step, want[:, :4]), (plain, want)):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5, atol=1e-5)
