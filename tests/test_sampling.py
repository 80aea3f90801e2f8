"""Sampling warps match a float64 numpy reference of transformers' order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspine_jax import row_keys
from dspine_jax.errors import InputError
from dspine_jax.runtime.requests import validate_sampling
from dspine_jax.sampling import (SamplingParams, sample_tokens, target_probabilities,
                                 top_k_indices, warp_logits)
from pallas_kernels.switches import Switches


def reference_probs(logits, temperature, top_p, top_k):
    """temperature -> top-k -> top-p over what top-k kept, in float64."""
    x = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-x)
    keep = np.zeros_like(x, bool)
    k = top_k if top_k > 0 else len(x)
    kept = order[:k]
    p = np.exp(x[kept] - x[kept].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    keep[kept[before < top_p]] = True
    out = np.where(keep, np.exp(x - x.max()), 0)
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_p,top_k", [
    (1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.5, 0.5, 10), (1.0, 0.3, 3), (2.0, 0.95, 1)])
def test_warp_matches_reference(temperature, top_p, top_k):
    logits = np.random.default_rng(0).normal(size=(3, 50)) * 3
    params = SamplingParams.create(3, temperature, top_p, top_k)
    got = np.asarray(jax.nn.softmax(warp_logits(jnp.asarray(logits, jnp.float32), params)))
    for row in range(3):
        np.testing.assert_allclose(got[row], reference_probs(logits[row], temperature, top_p,
                                                             top_k), atol=1e-6)


def test_warp_broadcasts_over_block_positions():
    logits = np.random.default_rng(1).normal(size=(2, 4, 30))
    params = SamplingParams(jnp.asarray([0.5, 1.0]), jnp.asarray([0.8, 1.0]),
                            jnp.asarray([0, 4], jnp.int32))
    got = np.asarray(jax.nn.softmax(warp_logits(jnp.asarray(logits, jnp.float32), params)))
    for t in range(4):
        np.testing.assert_allclose(got[0, t], reference_probs(logits[0, t], 0.5, 0.8, 0), atol=1e-6)
        np.testing.assert_allclose(got[1, t], reference_probs(logits[1, t], 1.0, 1.0, 4), atol=1e-6)


def test_zero_temperature_is_argmax_and_one_hot():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(4, 20)), jnp.float32)
    params = SamplingParams.create(4, 0.0)
    tokens = sample_tokens(logits, params, jax.random.key(0))
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))
    probs = target_probabilities(logits, params)
    np.testing.assert_array_equal(probs, jax.nn.one_hot(np.argmax(logits, -1), 20))


def test_samples_follow_the_warped_distribution():
    """Chi-square goodness of fit over 20k draws (p-value threshold 1e-4)."""
    from scipy.stats import chisquare

    logits = np.random.default_rng(3).normal(size=(12,)) * 0.5
    params = SamplingParams.create(20000, 0.8, 0.9, 6)
    batch = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (20000, 12))
    draws = np.asarray(sample_tokens(batch, params, jax.random.key(1)))
    expected = reference_probs(logits, 0.8, 0.9, 6)
    support = expected > 0
    assert 3 <= support.sum() < 12  # both filters bite, several tokens remain
    assert set(np.unique(draws)) <= set(np.flatnonzero(support))
    counts = np.bincount(draws, minlength=12)[support]
    assert chisquare(counts, expected[support] * 20000).pvalue > 1e-4


@pytest.mark.parametrize("kwargs,word", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k")])
def test_bad_sampling_params_are_named(kwargs, word):
    args = dict(temperature=1.0, top_p=1.0, top_k=0) | kwargs
    with pytest.raises(InputError, match=word):
        validate_sampling(**args)


def test_top_k_indices_match_numpy_on_any_rank():
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 50)).astype(np.float32)
    want = np.argsort(-x, axis=-1)[..., :5]                  # distinct values: no ties
    got = np.asarray(top_k_indices(jnp.asarray(x), 5))
    assert got.shape == (2, 3, 4, 5) and got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("branch_free", [True, False])
def test_unfiltered_batches_trace_no_threshold(branch_free, monkeypatch):
    """`all_unfiltered` (create() with top_p 1 and top_k 0) warps by temperature alone:
    the same distribution as the general path, and no sort or TopK in the program (the
    branch-free general path with the sort as its threshold, so that it shows one)."""
    monkeypatch.setattr("dspine_jax.sampling.branch_free", lambda: branch_free)
    with Switches(warp_threshold="sort").active():
        _unfiltered_traces_no_threshold(branch_free)


def _unfiltered_traces_no_threshold(branch_free):
    from dspine_jax.sampling import warp_stats

    logits = jnp.asarray(np.random.default_rng(4).normal(size=(3, 2, 40)) * 3, jnp.float32)
    fast = SamplingParams.create(3, 0.7)
    assert fast.all_unfiltered and not SamplingParams.create(3, 0.7, top_p=0.9).all_unfiltered
    assert not SamplingParams.create(3, 0.7, top_k=5).all_unfiltered
    general = fast.replace(all_unfiltered=False)
    np.testing.assert_allclose(jax.nn.softmax(warp_logits(logits, fast)),
                               jax.nn.softmax(warp_logits(logits, general)), atol=1e-6)
    for got, want in zip(warp_stats(logits, fast), warp_stats(logits, general)):
        np.testing.assert_allclose(got, want, atol=1e-6)
    for fn in (warp_logits, lambda x, p: warp_stats(x, p)[1]):
        text = str(jax.make_jaxpr(fn)(logits, fast))
        assert "sort" not in text and "top_k" not in text, text
        assert "sort" in str(jax.make_jaxpr(fn)(logits, general)) or not branch_free


def test_unfiltered_fast_path_can_be_switched_off():
    assert SamplingParams.create(2, 1.0).all_unfiltered
    with Switches(warp_unfiltered=False).active():
        assert not SamplingParams.create(2, 1.0).all_unfiltered


def test_batch_sampling_mode_ignores_greedy_rows_filters(monkeypatch):
    from dspine_jax.sampling import batch_sampling_mode, params_for_mode
    t, p, k = np.array([0.0, 0.7]), np.array([0.5, 1.0]), np.array([3, 0])
    assert batch_sampling_mode(t, p, k) == "unfiltered"
    assert batch_sampling_mode(np.zeros(2), p, k) == "greedy"
    assert batch_sampling_mode(t, np.array([0.5, 0.9]), k) == "filtered"
    assert batch_sampling_mode(t, p, np.array([3, 2])) == "filtered"
    with Switches(warp_unfiltered=False).active():
        assert batch_sampling_mode(t, p, k) == "filtered"
    params = params_for_mode(jnp.asarray(t), jnp.asarray(p), jnp.asarray(k), "unfiltered")
    assert params.all_unfiltered and not params.all_greedy
    with pytest.raises(ValueError, match="sampling mode"):
        params_for_mode(jnp.asarray(t), jnp.asarray(p), jnp.asarray(k), "fast")


@pytest.mark.parametrize("path", ["selection", "sort", "pallas"])
def test_sample_tokens_draws_from_warp_logits_set(path, monkeypatch):
    """sample_tokens warps by `warp_threshold` (as verification warps p), not by a sort:
    on the CPU's partial top-k and bisection, and on the branch-free path by the sort or
    the Pallas search (interpreted), each key draws the token that the same key draws
    from `warp_logits` (the sort's definition), and greedy rows take the argmax."""
    import functools

    from dspine_jax import sampling

    monkeypatch.setattr("dspine_jax.sampling.branch_free", lambda: path != "selection")
    monkeypatch.setattr("dspine_jax.sampling.threshold_rows", functools.partial(
        sampling.threshold_rows, interpret=path == "pallas"))
    logits = jnp.asarray(np.random.default_rng(7).normal(size=(4, 300)) * 3, jnp.float32)
    params = SamplingParams.create(4, 0.8, top_p=0.6, top_k=8).replace(
        temperature=jnp.asarray([0.8, 0.8, 0.0, 1.3], jnp.float32))
    with Switches(warp_threshold=path if path != "selection" else "pallas").active():
        for seed in range(24):
            key = jax.random.key(seed)
            got = sampling.sample_tokens(logits, params, key)
            want = jnp.where(params.temperature > 0,
                             row_keys.categorical(key, warp_logits(logits, params)),
                             jnp.argmax(logits, -1))
            np.testing.assert_array_equal(got, want)
