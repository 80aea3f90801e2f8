"""The exact acceptance probabilities of dspine_jax.speculative.acceptance against float64
numpy written the other way round: alpha = sum_x q(x) min(1, p(x) / q(x)), the mixtures
built in full, the chain rule as an explicit loop."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dspine_jax.speculative.acceptance import (expected_tokens, mixture_overlap, overlap,
                                               overlap_sparse, spliced_overlap)

V, C = 13, 4


def dist(rng, shape, sparse_to=None):
    """Random distributions [..., V] in float64, some entries exactly zero."""
    x = rng.gamma(0.5, size=shape + (V,)) * (rng.random(shape + (V,)) > 0.3)
    x[..., 0] += 1e-3                     # never all zero
    return x / x.sum(-1, keepdims=True)


def accept_prob(p, q):
    """sum_x q(x) * min(1, p(x) / q(x)): the probability that a draft from q is kept."""
    ratio = np.divide(p, q, out=np.ones_like(p), where=q > 0)
    return np.sum(q * np.minimum(1.0, ratio), -1)


def scatter(ids, values):
    """Sparse [..., C] on ids -> dense [..., V] float64."""
    out = np.zeros(ids.shape[:-1] + (V,))
    np.put_along_axis(out, ids, values, -1)
    return out


@pytest.fixture
def case():
    rng = np.random.default_rng(0)
    p, q = dist(rng, (3, 5)), dist(rng, (3, 5))                      # [N, S, V]
    ids = np.argsort(rng.random((3, 5, V)), -1)[..., :C]             # distinct per slot
    q_c = rng.dirichlet(np.ones(C), size=(3, 5))                     # [N, S, C]
    return p, q, ids, q_c


def test_overlap_is_the_acceptance_probability(case):
    p, q, _, _ = case
    got = overlap(jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32))
    np.testing.assert_allclose(got, accept_prob(p, q), atol=1e-6)
    assert np.allclose(overlap(jnp.asarray(p), jnp.asarray(p)), 1.0, atol=1e-6)


def test_sparse_spliced_and_mixed_q_match_their_dense_form(case):
    p, q, ids, q_c = case
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    sparse = scatter(ids, q_c)
    np.testing.assert_allclose(overlap_sparse(f32(p), jnp.asarray(ids), f32(q_c)),
                               accept_prob(p, sparse), atol=1e-6)
    # q outside the ids, rescaled q_c on them: a distribution again
    inside = np.take_along_axis(q, ids, -1).sum(-1, keepdims=True)
    spliced = np.where(scatter(ids, np.ones_like(q_c)) > 0, 0.0, q) + scatter(ids, inside * q_c)
    assert np.allclose(spliced.sum(-1), 1.0)
    np.testing.assert_allclose(
        spliced_overlap(f32(p), jnp.asarray(ids), f32(inside * q_c), f32(q)),
        accept_prob(p, spliced), atol=1e-6)
    for w in (0.0, 0.3, 1.0):
        mixed = (1 - w) * sparse + w * q
        np.testing.assert_allclose(
            mixture_overlap(f32(p), jnp.asarray(ids), f32(q_c), f32(q), w),
            accept_prob(p, mixed), atol=1e-6)


def test_expected_tokens_is_the_chain_rule():
    alpha = np.random.default_rng(1).random((4, 6))
    want = np.ones(4)
    for n in range(4):
        survive = 1.0
        for a in alpha[n]:
            survive *= a
            want[n] += survive
    np.testing.assert_allclose(expected_tokens(jnp.asarray(alpha, jnp.float32)), want,
                               rtol=1e-6)
    assert float(expected_tokens(jnp.ones(15))) == 16.0


def test_the_diagnostic_head_is_the_engine_head():
    """t1_acceptance's chain rows: the scores of the candidates are transition_scores given
    the true predecessor, and slot 1 (given the anchor, as the base pass was) over the whole
    vocabulary is the base logits."""
    from dspine_benchmarks.t1_acceptance import chain_given_truth, top_c
    from tests.test_engine import build

    target, drafter = build(kind="dspine", block=5)
    e_out = target.output_embedding()
    tokens = np.random.default_rng(3).integers(2, 61, size=24).astype(np.int32)
    anchors = np.asarray([4, 9, 13], np.int32)
    feats = target(jnp.asarray(tokens[None]),
                   hidden_layer_ids=drafter.config.target_layer_ids).features()
    out = drafter.forward_train(jnp.asarray(tokens[None]), feats, jnp.asarray(anchors[None]),
                                target.input_embedding(), e_out)
    labels = jnp.asarray(tokens[anchors[:, None] + 1 + np.arange(4)])       # [n, S]
    head = chain_given_truth(drafter, out, jnp.asarray(tokens[anchors]), labels, e_out, 6)
    cands, scores, pred_in = top_c(head, 4)
    preds = jnp.concatenate([jnp.asarray(tokens[anchors])[:, None], labels[:, :-1]], 1)
    want = drafter.transition_scores(out.pre_injection[0, :, 1:], preds[..., None],
                                     jnp.take(e_out, cands, axis=0), e_out)[..., 0, :]
    np.testing.assert_allclose(scores, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(head["full"][:, 0], out.logits[0, :, 1], rtol=1e-4, atol=1e-4)
    assert bool(pred_in[:, 0].all())
