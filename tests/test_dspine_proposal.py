"""pallas_kernels.dspine_proposal: every implementation against float64 numpy, and the
sparse DSpine/DFlash proposers against the dense ones they replace.

One test body per check runs against each implementation: "xla" (the reference),
"pallas_tpu" in TPU interpret mode and "pallas_gpu" in Pallas interpret mode, all on the
CPU; the `gpu`-marked tests run the GPU kernel compiled and skip where JAX has no CUDA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.dspine_proposal import (dspine_proposal, transition_table, vocab_top_k,
                                            walk_chain)
from pallas_kernels.switches import Switches
from tests.test_engine import build
from tests.test_losses import reference_transition_scores
from tests.test_sampling import reference_probs

INTERPRETED = ["xla", "pallas_tpu", "pallas_gpu"]
# (name, R rows, D, V, k, dtype)
CASES = [
    ("dspine_slots", 15, 64, 1000, 16, "float32"),     # V not a tile multiple
    ("tiny_vocab", 5, 48, 61, 6, "float32"),
    ("argmax", 33, 32, 300, 1, "bfloat16"),
    ("k_not_pow2_bf16", 7, 64, 700, 10, "bfloat16"),
]


def numpy_top_k(h, e, k):
    """Float64: values descending, ties to the lower id (a stable sort of -logits)."""
    logits = np.asarray(h, np.float64) @ np.asarray(e, np.float64).T
    order = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(logits, order, 1), order


def run(implementation, h, e, k):
    return vocab_top_k(jnp.asarray(h), jnp.asarray(e), k, implementation=implementation,
                       interpret=implementation != "xla")


@pytest.mark.parametrize("implementation", INTERPRETED)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_top_k_matches_float64_with_exact_ties(implementation, case):
    """Small-integer inputs: every logit is exact in float32 (and bf16 inputs), ties are
    frequent, so ids must match the stable float64 order exactly."""
    _, r, d, v, k, dtype = case
    rng = np.random.default_rng(r * v)
    h = jnp.asarray(rng.integers(-2, 3, size=(r, d)), dtype)
    e = jnp.asarray(rng.integers(-2, 3, size=(v, d)), dtype)
    vals, ids = run(implementation, h, e, k)
    want_v, want_i = numpy_top_k(h, e, k)
    assert vals.shape == (r, k) and vals.dtype == jnp.float32 and ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(vals, np.float64), want_v)
    np.testing.assert_array_equal(ids, want_i)


@pytest.mark.parametrize("implementation", INTERPRETED)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_top_k_matches_float64_random(implementation, case):
    _, r, d, v, k, dtype = case
    rng = np.random.default_rng(r + v)
    h = jnp.asarray(rng.standard_normal((r, d)), dtype)
    e = jnp.asarray(rng.standard_normal((v, d)), dtype)
    vals, ids = run(implementation, h, e, k)
    want_v, want_i = numpy_top_k(h, e, k)
    tol = (1e-5 if dtype == "float32" else 1e-2) * np.sqrt(d)
    np.testing.assert_allclose(vals, want_v, rtol=tol, atol=tol)
    logits = np.asarray(h, np.float64) @ np.asarray(e, np.float64).T
    # the returned ids hold the returned values, and no left-out logit beats them
    np.testing.assert_allclose(np.take_along_axis(logits, np.asarray(ids), 1), want_v,
                               rtol=tol, atol=tol)
    assert all(len(set(row)) == k for row in np.asarray(ids).tolist())


def test_auto_is_xla_on_cpu_and_bad_input_is_named():
    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU choice")
    h, e = jnp.ones((2, 16)), jnp.arange(64.0).reshape(4, 16)
    for a, x in zip(vocab_top_k(h, e, 2), vocab_top_k(h, e, 2, implementation="xla")):
        np.testing.assert_array_equal(a, x)
    with pytest.raises(ValueError, match="k must be"):
        vocab_top_k(h, e, 5)
    with pytest.raises(ValueError, match="implementation"):
        vocab_top_k(h, e, 2, implementation="cuda")
    with pytest.raises(ValueError, match="width"):
        vocab_top_k(h, jnp.ones((4, 8)), 2)


@pytest.mark.gpu
def test_gpu_kernel_compiled():
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a CUDA GPU; JAX backend here is {jax.default_backend()!r}")
    for case in CASES + [("smollm2", 15, 576, 49152, 16, "bfloat16"),
                         ("qwen3_8b_b8", 120, 4096, 151936, 16, "bfloat16")]:
        _, r, d, v, k, dtype = case
        rng = np.random.default_rng(0)
        h = jnp.asarray(rng.integers(-2, 3, size=(r, d)), dtype)
        e = jnp.asarray(rng.integers(-2, 3, size=(v, d)), dtype)
        vals, ids = vocab_top_k(h, e, k, implementation="pallas_gpu")
        want_v, want_i = numpy_top_k(h, e, k)
        np.testing.assert_array_equal(np.asarray(vals, np.float64), want_v)
        np.testing.assert_array_equal(ids, want_i)


# ----- the decoding head -------------------------------------------------------------------
def _head_inputs(seed=0, b=3):
    target, drafter = build(kind="dspine")
    e_out = target.output_embedding()
    s, c, d = 4, drafter.config.dspine.top_k, e_out.shape[1]
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((b, s, d)), jnp.float32)
    pre = jnp.asarray(rng.standard_normal((b, s, d)), jnp.float32)
    anchor = jnp.asarray(rng.integers(0, e_out.shape[0], size=b), jnp.int32)
    return target, drafter, e_out, hidden, pre, anchor, c


def test_transition_table_matches_the_drafter_and_float64():
    target, drafter, e_out, hidden, pre, anchor, c = _head_inputs()
    rng = np.random.default_rng(1)
    preds = jnp.asarray(rng.integers(0, e_out.shape[0], size=(3, 4, c)))
    rows = jnp.take(e_out, jnp.asarray(rng.integers(0, e_out.shape[0], size=(3, 4, c))), 0)
    weights = drafter.proposer().transition_weights()
    got = transition_table(pre, preds, rows, e_out, weights, drafter.norm.eps)
    np.testing.assert_array_equal(got, drafter.transition_scores(pre, preds, rows, e_out))
    ref = reference_transition_scores(drafter, np.asarray(pre), np.asarray(preds),
                                      np.asarray(rows), e_out)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5)


def numpy_walk(table, temperature=0.0, top_p=1.0, top_k=0, choices=None):
    """Float64: the greedy walk, or (choices given) the q of each step given the chosen
    predecessor."""
    table = np.asarray(table, np.float64)
    b, s, c, _ = table.shape
    pick = np.zeros((b, s), int)
    qs = np.zeros((b, s, c))
    for row in range(b):
        prev = 0
        for i in range(s):
            given = table[row, i, prev]
            if temperature == 0:
                pick[row, i] = int(np.argmax(given))
                qs[row, i, pick[row, i]] = 1
            else:
                qs[row, i] = reference_probs(given, temperature, top_p, top_k)
                pick[row, i] = choices[row, i]
            prev = pick[row, i]
    return pick, qs


@pytest.fixture(params=["steps", "all"])
def walk_mode(request):
    """Both ways a sampled walk draws (the chain_walk switch)."""
    with Switches(chain_walk=request.param).active():
        yield request.param


@pytest.mark.parametrize("sampling", [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.8, 0.9, 4)])
def test_walk_matches_float64(sampling, walk_mode):
    t, p, k = sampling
    table = jnp.asarray(np.random.default_rng(2).standard_normal((3, 5, 6, 6)) * 2,
                        jnp.float32)
    full = lambda x, dt: jnp.full((3,), x, dt)  # noqa: E731
    choice, q = walk_chain(table, full(t, jnp.float32), full(p, jnp.float32),
                           full(k, jnp.int32), jax.random.key(0), greedy=t == 0)
    pick, want_q = numpy_walk(table, t, p, k, np.asarray(choice))
    np.testing.assert_array_equal(choice, pick)
    np.testing.assert_allclose(q, want_q, atol=1e-6)
    assert np.all(np.take_along_axis(np.asarray(q), np.asarray(choice)[..., None], -1) > 0)


def test_sampled_walk_draws_the_chain(walk_mode):
    """Slot 2's pick depends on slot 1's: the joint of the two picks over 6,000 rows (one
    key each) against the float64 chain q_1(a) * q_2(b | a), by chi-square."""
    from tests.test_engine import chi2_pvalue

    n, c = 6000, 4
    rows = np.random.default_rng(7).standard_normal((1, 2, c, c)) * 1.5
    table = jnp.asarray(np.repeat(rows, n, 0), jnp.float32)
    full = lambda x, dt: jnp.full((n,), x, dt)  # noqa: E731
    keys = jax.vmap(jax.random.key)(jnp.arange(n))
    choice, q = walk_chain(table, full(1.0, jnp.float32), full(1.0, jnp.float32),
                           full(0, jnp.int32), keys, greedy=False)
    choice = np.asarray(choice)
    first = reference_probs(rows[0, 0, 0], 1.0, 1.0, 0)
    joint = np.stack([first[a] * reference_probs(rows[0, 1, a], 1.0, 1.0, 0)
                      for a in range(c)])
    counts = np.zeros((c, c))
    np.add.at(counts, (choice[:, 0], choice[:, 1]), 1)
    assert chi2_pvalue(counts, joint) > 1e-4
    np.testing.assert_allclose(np.asarray(q)[:, 1], np.stack(
        [reference_probs(rows[0, 1, a], 1.0, 1.0, 0) for a in choice[:, 0]]), atol=1e-6)


@pytest.mark.parametrize("implementation", INTERPRETED)
def test_dspine_proposal_matches_float64(implementation):
    """Candidates = float64 top-C of the hidden states; the greedy chain = float64 walk
    over the float64 transition table of those candidates."""
    target, drafter, e_out, hidden, pre, anchor, c = _head_inputs(seed=3)
    zeros = jnp.zeros((3,))
    cands, choice, q = dspine_proposal(
        hidden, pre, anchor, e_out, drafter.proposer().transition_weights(), zeros,
        jnp.ones((3,)), jnp.zeros((3,), jnp.int32), jax.random.key(0), num_candidates=c,
        eps=drafter.norm.eps, greedy=True, implementation=implementation,
        interpret=implementation != "xla")
    _, want_c = numpy_top_k(np.asarray(hidden).reshape(-1, hidden.shape[-1]), e_out, c)
    np.testing.assert_array_equal(np.asarray(cands).reshape(-1, c), want_c)
    want_c = want_c.reshape(cands.shape)
    preds = np.concatenate([np.broadcast_to(np.asarray(anchor)[:, None, None], (3, 1, c)),
                            want_c[:, :-1]], 1)
    table = reference_transition_scores(drafter, np.asarray(pre), preds,
                                        np.asarray(e_out)[want_c], e_out)
    pick, want_q = numpy_walk(table)
    np.testing.assert_array_equal(choice, pick)
    np.testing.assert_array_equal(q, want_q)


# ----- sparse proposers equal the dense ones -------------------------------------------------
SETTINGS = [dict(temperature=0.0), dict(temperature=1.0),
            dict(temperature=0.8, top_p=0.9, top_k=6)]


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
@pytest.mark.parametrize("setting", SETTINGS, ids=["T0", "T1", "T0.8-p0.9-k6"])
def test_sparse_proposal_equals_dense(kind, setting, walk_mode):
    from dspine_jax.drafters.model import DraftOutput
    from dspine_jax.sampling import SamplingParams

    target, drafter = build(kind=kind)
    e_out = target.output_embedding()
    b, k, d = 4, drafter.config.block_size, e_out.shape[1]
    rng = np.random.default_rng(4)
    hidden = jnp.asarray(rng.standard_normal((b, 1, k, d)) * 3, jnp.float32)
    logits = jnp.einsum("BnKD,VD->BnKV", hidden, e_out)
    out = DraftOutput(logits=logits, hidden=hidden,
                      pre_injection=jnp.asarray(rng.standard_normal((b, 1, k, d)), jnp.float32),
                      features=None, gates=None)
    anchor = jnp.asarray([1, 2, 3, 4])
    sampling = SamplingParams.create(b, **setting)
    key = jax.random.key(5)
    dense = drafter.proposer("dense").propose(out, anchor, e_out, sampling, key)
    sparse = drafter.proposer("sparse").propose(out, anchor, e_out, sampling, key)
    if kind == "dspine" or setting["temperature"] == 0:  # DFlash draws by another sampler
        np.testing.assert_array_equal(sparse.tokens, dense.tokens)
    np.testing.assert_allclose(sparse.dense_q(), dense.q, atol=1e-6)
    np.testing.assert_allclose(sparse.token_q(), np.take_along_axis(
        np.asarray(dense.q), np.asarray(sparse.tokens)[..., None], -1)[..., 0], atol=1e-6)
    assert np.all(np.asarray(sparse.token_q()) > 0)
    for n in ([0, 1, 2, 3], [4, 3, 0, 4]):     # n = S: the bonus row, q = 0
        n = jnp.asarray(n)
        want = np.where((np.asarray(n) < k - 1)[:, None],
                        np.asarray(dense.q)[np.arange(b), np.minimum(n, k - 2)], 0)
        np.testing.assert_allclose(sparse.q_row(n), want, atol=1e-6)
