"""pallas_kernels.lm_head_stats: every implementation against float64 numpy (values,
ranks with exact ties, and the gradient in hidden), and against the dense reference.

"xla" (vocabulary chunks under lax.scan) and the Pallas forwards run on the CPU:
"pallas_tpu" in TPU interpret mode, "pallas_gpu" in Pallas interpret mode; the
`gpu`-marked test compiles the GPU kernel and skips where JAX has no CUDA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lm_head_stats import lm_head_stats, lm_head_stats_reference

IMPLEMENTATIONS = ["xla", "pallas_tpu", "pallas_gpu"]
# (name, R rows, D, V, chunk of the xla passes, dtype)
CASES = [
    ("slots", 37, 64, 1000, 128, "float32"),          # V not a multiple of any tile
    ("tiny_vocab", 5, 48, 61, 16, "float32"),         # V below one kernel tile
    ("one_chunk", 9, 32, 300, 4096, "bfloat16"),      # chunk past V
    ("bf16", 70, 64, 700, 256, "bfloat16"),           # R past one GPU row tile
]


def numpy_stats(h, e, labels):
    """Float64 lse, label logit and lax.top_k rank (stable order of -logits)."""
    logits = np.asarray(h, np.float64) @ np.asarray(e, np.float64).T
    top = logits.max(1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(1, keepdims=True)))[:, 0]
    order = np.argsort(-logits, axis=1, kind="stable")
    rank = np.argmax(order == np.asarray(labels)[:, None], axis=1)
    return lse, logits[np.arange(len(labels)), labels], rank


def run(implementation, h, e, labels, chunk):
    return lm_head_stats(jnp.asarray(h), jnp.asarray(e), jnp.asarray(labels),
                         implementation=implementation, chunk=chunk,
                         interpret=implementation != "xla")


def _inputs(case, integers: bool, seed=0):
    _, r, d, v, chunk, dtype = case
    rng = np.random.default_rng(seed + r * v)
    draw = ((lambda shape: rng.integers(-2, 3, size=shape)) if integers
            else (lambda shape: rng.standard_normal(shape)))
    h = jnp.asarray(draw((r, d)), dtype)
    e = jnp.asarray(draw((v, d)), dtype)
    labels = rng.integers(0, v, size=r).astype(np.int32)
    return h, e, labels, chunk


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_stats_match_float64_with_exact_ties(implementation, case):
    """Small-integer inputs: every logit is exact in float32, ties are frequent, so the
    label logit and the rank must equal float64's exactly (ties to the lower id)."""
    h, e, labels, chunk = _inputs(case, integers=True)
    lse, value, rank = run(implementation, h, e, labels, chunk)
    want_lse, want_value, want_rank = numpy_stats(h, e, labels)
    assert lse.dtype == value.dtype == jnp.float32 and rank.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(value, np.float64), want_value)
    np.testing.assert_array_equal(rank, want_rank)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_stats_match_float64_random(implementation, case):
    h, e, labels, chunk = _inputs(case, integers=False)
    lse, value, rank = run(implementation, h, e, labels, chunk)
    want_lse, want_value, want_rank = numpy_stats(h, e, labels)
    d = h.shape[1]
    tol = (1e-5 if h.dtype == jnp.float32 else 1e-2) * np.sqrt(d)
    np.testing.assert_allclose(value, want_value, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=tol, atol=tol)
    if h.dtype == jnp.float32:     # no two logits within float32 rounding of each other
        np.testing.assert_array_equal(rank, want_rank)
    # and the same numbers as the dense reference on the same inputs
    ref = lm_head_stats_reference(h, e, jnp.asarray(labels))
    np.testing.assert_array_equal(rank, ref[2])
    np.testing.assert_allclose(value, ref[1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, ref[0], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=[CASES[0][0], CASES[3][0]])
def test_gradient_in_hidden_matches_float64(implementation, case):
    """d/d hidden of sum(a * lse + b * label_logit) is a * softmax @ E + b * E[label]
    (float64 numpy); the weight gets none."""
    h, e, labels, chunk = _inputs(case, integers=False, seed=1)
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.standard_normal(h.shape[0]), jnp.float32)
    b = jnp.asarray(rng.standard_normal(h.shape[0]), jnp.float32)

    def objective(h, e):
        lse, value, _ = lm_head_stats(h, e, jnp.asarray(labels), implementation=implementation,
                                      chunk=chunk, interpret=implementation != "xla")
        return jnp.sum(a * lse + b * value)

    grad_h, grad_e = jax.grad(objective, argnums=(0, 1))(h, e)
    logits = np.asarray(h, np.float64) @ np.asarray(e, np.float64).T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    e64 = np.asarray(e, np.float64)
    want = np.asarray(a)[:, None] * (p @ e64) + np.asarray(b)[:, None] * e64[labels]
    assert grad_h.dtype == h.dtype
    tol = 1e-4 if h.dtype == jnp.float32 else 5e-2
    np.testing.assert_allclose(np.asarray(grad_h, np.float64), want, rtol=tol,
                               atol=tol * np.abs(want).max())
    assert not np.any(np.asarray(grad_e))


def test_gradient_equals_the_dense_reference_under_jit():
    """The chunked backward inside a jitted value_and_grad, as the training loss uses it."""
    h, e, labels, chunk = _inputs(CASES[0], integers=False, seed=3)
    labels = jnp.asarray(labels)

    def loss(h, fn):
        lse, value, rank = fn(h)
        return jnp.mean(lse - value) + jnp.mean(rank < 4)

    fused = jax.jit(jax.value_and_grad(lambda h: loss(h, lambda x: lm_head_stats(
        x, e, labels, implementation="xla", chunk=chunk))))
    dense = jax.jit(jax.value_and_grad(lambda h: loss(h, lambda x: lm_head_stats_reference(
        x, e, labels))))
    (v1, g1), (v2, g2) = fused(h), dense(h)
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    np.testing.assert_allclose(g1, g2, rtol=1e-4, atol=1e-6)


def numpy_top_k(h, e, k):
    """Float64 ids of the k largest logits, value descending, ties to the lower id."""
    logits = np.asarray(h, np.float64) @ np.asarray(e, np.float64).T
    return np.argsort(-logits, axis=1, kind="stable")[:, :k]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_top_k_ids_come_with_unchanged_stats(implementation, case):
    """top_k: the ids of the largest logits (exact ties to the lower id, as float64's
    stable order) beside the same stats and the same gradient as without."""
    h, e, labels, chunk = _inputs(case, integers=True, seed=3)
    k = 16
    *stats, ids = lm_head_stats(h, e, jnp.asarray(labels), implementation=implementation,
                                chunk=chunk, interpret=implementation != "xla", top_k=k)
    assert ids.shape == (h.shape[0], k) and ids.dtype == jnp.int32
    np.testing.assert_array_equal(ids, numpy_top_k(h, e, k))
    for got, want in zip(stats, run(implementation, h, e, labels, chunk)):
        np.testing.assert_array_equal(got, want)

    def lse_sum(x, top_k):
        return jnp.sum(lm_head_stats(x, e, jnp.asarray(labels),
                                     implementation=implementation, chunk=chunk,
                                     interpret=implementation != "xla", top_k=top_k)[0])
    np.testing.assert_array_equal(jax.grad(lse_sum)(h.astype(jnp.float32), k),
                                  jax.grad(lse_sum)(h.astype(jnp.float32), 0))


def test_gpu_kernel_with_top_k_lowers_for_cuda():
    """The stats-and-top-k kernel lowers to Triton for a CUDA GPU from this CPU (what a GPU
    compiles), at the SmolLM2 training loss's shape."""
    h = jax.ShapeDtypeStruct((16384, 576), jnp.bfloat16)
    e = jax.ShapeDtypeStruct((49152, 576), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((16384,), jnp.int32)
    lowered = jax.jit(lambda h, e, l: lm_head_stats(h, e, l, implementation="pallas_gpu",
                                                    top_k=16)).trace(h, e, labels).lower(
        lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("triton") >= 1 and "lm_head_stats_top_k" in text


def test_auto_is_xla_on_cpu_and_bad_input_is_named():
    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU choice")
    h, e, labels = jnp.ones((2, 16)), jnp.arange(64.0).reshape(4, 16), jnp.array([0, 3])
    for a, x in zip(lm_head_stats(h, e, labels),
                    lm_head_stats(h, e, labels, implementation="xla")):
        np.testing.assert_array_equal(a, x)
    with pytest.raises(ValueError, match="implementation"):
        lm_head_stats(h, e, labels, implementation="cuda")
    with pytest.raises(ValueError, match="width"):
        lm_head_stats(h, jnp.ones((4, 8)), labels)
    with pytest.raises(ValueError, match="labels"):
        lm_head_stats(h, e, jnp.array([0, 1, 2]))
    with pytest.raises(ValueError, match="chunk"):
        lm_head_stats(h, e, labels, chunk=0)
    with pytest.raises(ValueError, match="dtype"):
        lm_head_stats(h.astype(jnp.float16), e, labels)
    with pytest.raises(ValueError, match="top_k must be an int in 0..V=4"):
        lm_head_stats(h, e, labels, top_k=5)


@pytest.mark.gpu
def test_gpu_kernel_compiled():
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a CUDA GPU; JAX backend here is {jax.default_backend()!r}")
    for case in CASES + [("smollm2_training", 4096, 576, 49152, 8192, "bfloat16"),
                         ("qwen3_8b", 512, 4096, 151936, 8192, "bfloat16")]:
        h, e, labels, chunk = _inputs(case, integers=True)
        lse, value, rank = lm_head_stats(h, e, jnp.asarray(labels),
                                         implementation="pallas_gpu")
        want_lse, want_value, want_rank = numpy_stats(h, e, labels)
        np.testing.assert_array_equal(np.asarray(value, np.float64), want_value)
        np.testing.assert_array_equal(rank, want_rank)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-4)
        *stats, ids = lm_head_stats(h, e, jnp.asarray(labels), implementation="pallas_gpu",
                                    top_k=16)
        np.testing.assert_array_equal(ids, numpy_top_k(h, e, 16))
        for got, want in zip(stats, (lse, value, rank)):
            np.testing.assert_array_equal(got, want)
