"""pallas_kernels.warp_threshold: every implementation keeps the set the float64 sort of
each row keeps (top-k, then top-p over what top-k kept)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.warp_threshold import IMPLEMENTATIONS, warp_threshold
from pallas_kernels.warp_threshold.search import candidates, narrow, rounds


def numpy_kept(x: np.ndarray, k: np.ndarray, top_p: np.ndarray):
    """float64: (kept [R, V] bool, the mass before each entry in sorted order [R, V])."""
    x = x.astype(np.float64)
    kept = np.zeros(x.shape, bool)
    before = np.zeros(x.shape)
    for r, row in enumerate(x):
        order = np.argsort(-row, kind="stable")
        vals = row[order][: k[r]]
        probs = np.exp(vals - vals[0])
        probs /= probs.sum()
        mass_before = np.cumsum(probs) - probs
        n = max(int(np.sum(mass_before < top_p[r])) if top_p[r] < 1 else k[r], 1)
        kept[r] = row >= vals[n - 1]
        before[r, order[: k[r]]] = mass_before
        before[r, order[k[r]:]] = 2.0
    return kept, before


def check(implementation, x, k, top_p, *, ways=16, interpret=True, tolerance=1e-5):
    tau = warp_threshold(jnp.asarray(x), jnp.asarray(k), jnp.asarray(top_p),
                         implementation=implementation, ways=ways,
                         interpret=interpret and implementation == "pallas_gpu")
    got = np.asarray(x) >= np.asarray(tau)[:, None]
    want, before = numpy_kept(np.asarray(x), k, top_p)
    # Only a token whose mass-before lies within float32 rounding of top_p may differ.
    differ = got != want
    near = np.abs(before - top_p[:, None]) < tolerance
    assert not (differ & ~near).any(), (implementation, np.argwhere(differ & ~near)[:5])
    return got


def cases(seed=0):
    """(name, x [R, V] float32, k [R], top_p [R]): continuous rows, exact ties, -inf
    entries, peaked and flat rows, a vocabulary that is not a multiple of the tile."""
    rng = np.random.default_rng(seed)
    v = 2500
    normal = (rng.standard_normal((8, v)) * 3).astype(np.float32)
    ties = rng.integers(-4, 5, size=(8, v)).astype(np.float32)
    masked = normal.copy()
    masked[:, ::3] = -np.inf
    peaked = normal.copy()
    peaked[:, 7] += 40.0
    flat = np.zeros((8, v), np.float32) + rng.standard_normal((8, v)).astype(np.float32) * 1e-3
    small = (rng.standard_normal((8, 37)) * 2).astype(np.float32)
    k = np.array([v, v, 1, 7, 300, v, 2499, v], np.int32)
    top_p = np.array([0.9, 0.5, 0.9, 1.0, 0.95, 0.999, 0.7, 0.05], np.float32)
    yield "normal", normal, k, top_p
    yield "ties", ties, k, top_p
    yield "masked", masked, np.minimum(k, v - v // 3 - 1), top_p
    yield "peaked", peaked, k, top_p
    yield "flat", flat, k, top_p
    yield "short_rows", small, np.array([37, 1, 5, 37, 36, 2, 37, 10], np.int32), top_p


# (implementation, candidates per round): the default 16, and more and fewer ways, whose
# rounds split intervals unevenly (2: 32 rounds; 64: 6 rounds of 6 bits for 32; 256: 4).
VARIANTS = [("sort", 16), ("search", 16), ("search", 2), ("search", 64), ("search", 256),
            ("pallas_gpu", 16), ("pallas_gpu", 64)]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}-{v[1]}")
@pytest.mark.parametrize("case", list(cases()), ids=lambda c: c[0])
def test_kept_set_matches_the_float64_sort(variant, case):
    _, x, k, top_p = case
    implementation, ways = variant
    got = check(implementation, x, k, top_p, ways=ways)
    assert got.any(axis=1).all()                       # every row keeps a token
    np.testing.assert_array_equal(got.sum(1) >= 1, True)


def test_searches_agree_with_each_other_exactly():
    """The kernel and the XLA search follow one rule (search.py): the same tau, bit for
    bit, on rows whose masses need no rounding luck (exact ties)."""
    _, x, k, top_p = next(c for c in cases(1) if c[0] == "ties")
    args = jnp.asarray(x), jnp.asarray(k), jnp.asarray(top_p)
    np.testing.assert_array_equal(
        warp_threshold(*args, implementation="search"),
        warp_threshold(*args, implementation="pallas_gpu", interpret=True))


def test_rounds_close_any_int32_interval():
    assert [rounds(w) for w in (2, 4, 16, 64, 256)] == [32, 16, 8, 6, 4]
    for ways in (16, 64):
        lo, hi = jnp.int32(-2**31), jnp.int32(2**31 - 1)   # the widest interval
        for _ in range(rounds(ways)):
            cand = candidates(lo, hi, ways)
            lo, hi = narrow(cand, cand <= 12345, hi)         # the largest key <= 12345
        assert int(lo) == 12345 and int(hi) == 12345
    with pytest.raises(ValueError, match="power of two"):
        rounds(24)


def test_bad_input_is_named():
    x = jnp.zeros((2, 8))
    with pytest.raises(ValueError, match="implementation must be one of"):
        warp_threshold(x, jnp.full((2,), 8), jnp.full((2,), 0.9), implementation="cuda")
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        warp_threshold(x, jnp.full((3,), 8), jnp.full((2,), 0.9))


def test_gpu_kernel_lowers_for_cuda():
    """The kernel lowers to Triton for a CUDA GPU from this CPU at a Qwen3-8B verify's
    shape (8 rows x 16 positions of a 151,936-token vocabulary)."""
    x = jax.ShapeDtypeStruct((128, 151936), jnp.float32)
    r = jax.ShapeDtypeStruct((128,), jnp.int32)
    p = jax.ShapeDtypeStruct((128,), jnp.float32)
    text = jax.jit(lambda x, k, p: warp_threshold(x, k, p, implementation="pallas_gpu")
                   ).trace(x, r, p).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "warp_threshold" in text


@pytest.mark.gpu
def test_gpu_kernel_compiled():
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a CUDA GPU; JAX backend here is {jax.default_backend()!r}")
    for _, x, k, top_p in cases(2):
        for ways in (16, 64):
            check("pallas_gpu", x, k, top_p, ways=ways, interpret=False)
    rng = np.random.default_rng(3)
    for rows, vocab in ((15, 49152), (128, 151936)):
        x = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
        k = rng.choice([vocab, 50, 2000], rows).astype(np.int32)
        top_p = rng.choice([0.9, 0.5, 1.0], rows).astype(np.float32)
        for ways in (16, 64):
            check("pallas_gpu", x, k, top_p, ways=ways, interpret=False)


def test_rows_benchmark_times_every_implementation(tmp_path):
    """The benchmark runs every implementation (each kept set checked against the sort's
    first) and writes one JSON row per implementation; the kernel needs a GPU or
    --interpret."""
    import json

    from dspine_benchmarks import warp_threshold_rows

    out = tmp_path / "rows.jsonl"
    warp_threshold_rows.main(["--rows", "16", "--vocab", "3000", "--iters", "2",
                              "--repeats", "1", "--top-k", "100", "--interpret",
                              "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["implementation"] for r in rows] == list(IMPLEMENTATIONS)
    assert all(r["us"] > 0 and r["one_read_us"] > 0 and r["vocab"] == 3000 for r in rows)
    if jax.default_backend() != "gpu":
        with pytest.raises(SystemExit):
            warp_threshold_rows.main(["--rows", "16", "--vocab", "3000"])


def test_rows_benchmark_tolerates_rounding_only():
    """The benchmark's check passes two thresholds apart by a token at the top-p boundary
    (within rounding) and fails them apart by any other token."""
    from dspine_benchmarks.warp_threshold_rows import rounding_only

    x = np.float32([[4.0, 3.0, 2.0, 1.0]])
    vals = np.exp(np.float64([4.0, 3.0, 2.0, 1.0]) - 4)
    top_p = float(np.float32(vals[:2].sum() / vals.sum()))      # token 2's mass-before
    assert rounding_only(x, np.float32([2.0]), np.float32([3.0]), 4, top_p)
    assert not rounding_only(x, np.float32([1.0]), np.float32([3.0]), 4, top_p)
