"""DSpine's sampling options (`DSpineConfig.chain_temperature`, `marginal_tail`,
`vocabulary_chain`): the draws follow the q the proposal reports (so verification stays
exact), greedy rows walk as before, the chain temperature is the T * factor warp, the
vocabulary chain's rows are the head's refined logits over every token, the config
round-trips, and the engine's output follows the target's distribution with the options
on (chi-square, as tests/test_engine.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspine_jax.drafters.config import DrafterConfig, DSpineConfig
from dspine_jax.drafters.model import DraftOutput
from dspine_jax.engine import SpeculativeEngine
from dspine_jax.errors import ConfigError
from dspine_jax.sampling import SamplingParams, warp_logits
from dspine_jax.speculative.propose import (walk_chain, walk_chain_with_tail,
                                            walk_vocabulary_chain)
from tests.test_engine import (SAMPLING, SMALL, TARGET, build, chi2_pvalue,
                               exact_two_token_distribution, sample_pairs)

V, S, C, N = 9, 2, 4, 40000
SETTINGS = [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9, top_k=6)]


def with_options(drafter, **options):
    drafter.config = dataclasses.replace(
        drafter.config, dspine=dataclasses.replace(drafter.config.dspine, **options))
    return drafter


def tail_inputs(rows: int):
    """One random case (table [1, S, C, C], distinct candidates, logits [1, S, V]) repeated
    over `rows` rows."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((1, S, C, C)) * 2
    cands = np.stack([rng.permutation(V)[:C] for _ in range(S)])[None]
    logits = rng.standard_normal((1, S, V)) * 1.5
    rep = lambda x, dt: jnp.asarray(np.repeat(x, rows, 0), dt)  # noqa: E731
    return rep(table, jnp.float32), rep(cands, jnp.int32), rep(logits, jnp.float32)


def reported_q(prop):
    """(q [N, S, V] float64, tokens [N, S]) of a proposal, after checking that its three
    views of q agree: every row sums to 1, token_q is q at the drafted token, and q_row(n)
    is slot n's row (zeros past the last slot)."""
    q = np.asarray(prop.dense_q(), np.float64)
    tokens = np.asarray(prop.tokens)
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(prop.token_q(), np.take_along_axis(q, tokens[..., None],
                                                                  -1)[..., 0], atol=1e-6)
    for n in range(S + 1):
        want = q[:, n] if n < S else np.zeros_like(q[:, 0])
        np.testing.assert_allclose(prop.q_row(jnp.full((N,), n)), want, atol=1e-6)
    return q, tokens


@pytest.mark.parametrize("setting", SETTINGS, ids=["T1", "T0.8-p0.9-k6"])
def test_tail_draws_follow_the_reported_q(setting):
    table, cands, logits = tail_inputs(N)
    sampling = SamplingParams.create(N, **setting)
    chain = sampling.replace(temperature=sampling.temperature * 1.5)
    keys = jax.vmap(jax.random.key)(jnp.arange(N))
    prop = walk_chain_with_tail(table, cands, logits, sampling, chain, keys)
    q, tokens = reported_q(prop)
    # The joint of slots 1 and 2: q_1 is every row's own; q_2 depends on slot 1's token.
    joint = np.zeros((V, V))
    for v in np.unique(tokens[:, 0]):
        rows = np.flatnonzero(tokens[:, 0] == v)
        np.testing.assert_allclose(q[rows, 1], q[rows[:1], 1].repeat(len(rows), 0), atol=1e-6)
        joint[v] = q[0, 0, v] * q[rows[0], 1]
    counts = np.zeros((V, V))
    np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
    assert chi2_pvalue(counts, joint) > 1e-4
    outside = ~np.any(np.asarray(cands) == tokens[..., None], -1)
    assert outside.mean() > 0.05          # the tail is drawn from, at both slots


@pytest.mark.parametrize("setting", SETTINGS, ids=["T1", "T0.8-p0.9-k6"])
def test_vocabulary_chain_draws_follow_the_reported_q(setting):
    """A made-up head: slot i's logits given predecessor v are W[i, v] (float64 numpy
    holds the reference); the joint of slots 1 and 2 is q_1(v) q_2(w | v)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((S, V, V)) * 1.5                           # [S, pred, V]
    states = jnp.broadcast_to(jnp.arange(S, dtype=jnp.float32)[None, :, None], (N, S, 1))
    table = jnp.asarray(w, jnp.float32)

    def slot_logits(state, pred):                                      # [N, 1], [N]
        return table[state[:, 0].astype(jnp.int32), pred]

    sampling = SamplingParams.create(N, **setting)
    keys = jax.vmap(jax.random.key)(jnp.arange(N))
    anchor = jnp.full((N,), 2, jnp.int32)
    prop = walk_vocabulary_chain(slot_logits, states, anchor, sampling, keys)
    q, tokens = reported_q(prop)

    def warped(logits):                                                # float64 reference
        x = logits / setting["temperature"]                            # top-k, then top-p
        order = np.argsort(-x)[:setting.get("top_k", 0) or V]          # over the top-k set
        probs = np.exp(x[order] - x.max()) / np.exp(x[order] - x.max()).sum()
        kept = order[np.cumsum(probs) - probs < setting.get("top_p", 1.0)]
        out = np.zeros(V)
        out[kept] = np.exp(x[kept] - x.max())
        return out / out.sum()

    np.testing.assert_allclose(q[0, 0], warped(w[0, 2]), atol=1e-5)   # given the anchor
    for v in range(V):
        rows = np.flatnonzero(tokens[:, 0] == v)
        if len(rows):
            np.testing.assert_allclose(q[rows[0], 1], warped(w[1, v]), atol=1e-5)
    joint = q[0, 0][:, None] * np.stack([warped(w[1, v]) for v in range(V)])
    counts = np.zeros((V, V))
    np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
    assert chi2_pvalue(counts, joint) > 1e-4


@pytest.mark.parametrize("impl", ["sparse", "dense"])
def test_vocabulary_chain_rows_are_the_head_over_every_token(impl):
    """Each slot's q is the warped softmax of the head's scores of every vocabulary row
    given the drawn predecessor (`transition_scores` with all rows as candidates); greedy
    rows of a mixed batch take that row's argmax."""
    target, drafter = build(kind="dspine")
    with_options(drafter, vocabulary_chain=True, chain_temperature=1.25)
    e_out = target.output_embedding()
    b = 4
    out, anchor = draft_output(drafter, e_out, b), jnp.asarray([1, 2, 3, 4])
    sampling = SamplingParams(temperature=jnp.asarray([1.0, 0.0, 0.7, 1.3]),
                              top_p=jnp.asarray([1.0, 1.0, 0.9, 1.0]),
                              top_k=jnp.asarray([0, 0, 0, 5], jnp.int32))
    prop = drafter.proposer(impl).propose(out, anchor, e_out, sampling, jax.random.key(3))
    tokens, q = np.asarray(prop.tokens), np.asarray(prop.dense_q(), np.float64)
    preds = np.concatenate([np.asarray(anchor)[:, None], tokens[:, :-1]], 1)   # [B, S]
    scores = drafter.transition_scores(out.pre_injection[:, 0, 1:], jnp.asarray(preds)[..., None],
                                       jnp.broadcast_to(e_out, (b, preds.shape[1]) + e_out.shape),
                                       e_out)[:, :, 0]                      # [B, S, V]
    chain = sampling.replace(temperature=sampling.temperature * 1.25)
    want = jax.nn.softmax(warp_logits(scores, chain), -1)
    np.testing.assert_allclose(q[[0, 2, 3]], np.asarray(want)[[0, 2, 3]], atol=2e-5)
    np.testing.assert_array_equal(tokens[1], np.argmax(np.asarray(scores)[1], -1))
    np.testing.assert_array_equal(q[1], np.eye(e_out.shape[0])[tokens[1]])


def test_greedy_rows_walk_as_the_chain():
    table, cands, logits = tail_inputs(2)
    sampling = SamplingParams(temperature=jnp.asarray([0.0, 1.0]), top_p=jnp.ones((2,)),
                              top_k=jnp.zeros((2,), jnp.int32))
    prop = walk_chain_with_tail(table, cands, logits, sampling, sampling, jax.random.key(0))
    tokens, _, q = walk_chain(table, cands, SamplingParams.create(2), jax.random.key(0))
    np.testing.assert_array_equal(prop.tokens[0], tokens[0])
    np.testing.assert_array_equal(prop.q[0], q[0])
    np.testing.assert_array_equal(prop.dense_q()[0].sum(-1), np.ones(S))


def draft_output(drafter, e_out, b=4, seed=4):
    rng = np.random.default_rng(seed)
    k, d = drafter.config.block_size, e_out.shape[1]
    hidden = jnp.asarray(rng.standard_normal((b, 1, k, d)) * 3, jnp.float32)
    return DraftOutput(logits=jnp.einsum("BnKD,VD->BnKV", hidden, e_out), hidden=hidden,
                       pre_injection=jnp.asarray(rng.standard_normal((b, 1, k, d)),
                                                 jnp.float32),
                       features=None, gates=None)


@pytest.mark.parametrize("impl", ["sparse", "dense"])
def test_chain_temperature_is_the_scaled_warp(impl):
    target, drafter = build(kind="dspine")
    e_out = target.output_embedding()
    out, anchor, key = draft_output(drafter, e_out), jnp.asarray([1, 2, 3, 4]), jax.random.key(5)
    plain = drafter.proposer(impl).propose(out, anchor, e_out, SamplingParams.create(4, 1.5),
                                           key)
    with_options(drafter, chain_temperature=1.5)
    scaled = drafter.proposer(impl).propose(out, anchor, e_out, SamplingParams.create(4, 1.0),
                                            key)
    np.testing.assert_array_equal(scaled.tokens, plain.tokens)
    np.testing.assert_allclose(scaled.dense_q(), plain.dense_q(), atol=1e-6)
    greedy = SamplingParams.create(4, 0.0)   # T = 0: the options change nothing
    with_options(drafter, marginal_tail=True)
    np.testing.assert_array_equal(
        drafter.proposer(impl).propose(out, anchor, e_out, greedy, key).tokens,
        with_options(drafter, chain_temperature=1.0, marginal_tail=False).proposer(impl)
        .propose(out, anchor, e_out, greedy, key).tokens)


@pytest.mark.parametrize("setting", [(2.0, 1.0, 0), (0.8, 0.9, 6)])
def test_sparse_tail_equals_dense_tail(setting):
    target, drafter = build(kind="dspine")
    with_options(drafter, marginal_tail=True, chain_temperature=1.5)
    e_out = target.output_embedding()
    b, key = 16, jax.random.key(5)
    out, anchor = draft_output(drafter, e_out, b), jnp.arange(1, b + 1)
    sampling = SamplingParams.create(b, *setting)
    sparse = drafter.proposer("sparse").propose(out, anchor, e_out, sampling, key)
    dense = drafter.proposer("dense").propose(out, anchor, e_out, sampling, key)
    np.testing.assert_array_equal(sparse.tokens, dense.tokens)
    np.testing.assert_allclose(sparse.dense_q(), dense.q, atol=1e-6)
    if setting[0] == 2.0:                                 # some draft came from the tail
        tokens = np.asarray(sparse.tokens)[..., None]
        assert np.any(~np.any(np.asarray(sparse.candidates) == tokens, -1))


def test_decoding_options_round_trip_through_config_json():
    spine = DSpineConfig(transfer_rank=16, message_size=8, top_k=6)
    config = DrafterConfig.for_target(TARGET, kind="dspine", num_layers=2, mask_token_id=1,
                                      dspine=spine)
    assert "dspine_jax_decoding" not in config.to_hf()     # defaults leave config.json as is
    tuned = dataclasses.replace(config, dspine=dataclasses.replace(
        spine, chain_temperature=1.5, marginal_tail=True))
    raw = tuned.to_hf()
    assert raw["dspine_jax_decoding"] == {"chain_temperature": 1.5, "marginal_tail": True}
    assert DrafterConfig.from_hf(raw) == tuned
    whole = dataclasses.replace(config, dspine=dataclasses.replace(spine, vocabulary_chain=True))
    assert whole.to_hf()["dspine_jax_decoding"] == {"vocabulary_chain": True}
    assert DrafterConfig.from_hf(whole.to_hf()) == whole
    with pytest.raises(ConfigError, match="exclude each other"):
        dataclasses.replace(spine, marginal_tail=True, vocabulary_chain=True)
    with pytest.raises(ConfigError, match="vocabulary_chain must be true or false"):
        dataclasses.replace(spine, vocabulary_chain="yes")
    with pytest.raises(ConfigError, match="dspine_jax_decoding has unknown"):
        DrafterConfig.from_hf({**raw, "dspine_jax_decoding": {"temperature": 2.0}})
    for bad in (0.0, -1.0, float("inf"), "1.5", True):
        with pytest.raises(ConfigError, match="chain_temperature"):
            dataclasses.replace(spine, chain_temperature=bad)


OPTION_SETS = {"tail": dict(marginal_tail=True, chain_temperature=1.5),
               "vocabulary": dict(vocabulary_chain=True, chain_temperature=1.25)}


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
@pytest.mark.parametrize("sampling_args", SAMPLING)
def test_sampling_with_the_options_follows_the_target_distribution(sampling_args, options):
    target, drafter = build(SMALL, kind="dspine", block=4, scale=6.0)
    with_options(drafter, **options)
    engine = SpeculativeEngine(target, drafter)
    prompt = [3, 1, 4]
    joint = exact_two_token_distribution(target, prompt, sampling_args)
    counts = sample_pairs(engine, prompt, sampling_args, seed=11)
    assert chi2_pvalue(counts, joint) > 1e-4


def test_t1_engine_variants_are_the_shipped_drafter_with_the_options(tmp_path):
    from dspine_benchmarks.t1_engine import variant_folder
    from dspine_jax.drafters.checkpoint import read_drafter_config
    from dspine_jax.registry import resolve_drafter

    shipped = resolve_drafter("smollm2-135m-instruct-dspine")
    folder = variant_folder(shipped, {"marginal_tail": True, "chain_temperature": 1.5,
                                      "top_k": 64}, tmp_path / "v")
    spine, base = read_drafter_config(folder).dspine, read_drafter_config(shipped).dspine
    assert (spine.marginal_tail, spine.chain_temperature, spine.top_k) == (True, 1.5, 64)
    assert dataclasses.replace(spine, marginal_tail=False, chain_temperature=1.0,
                               top_k=base.top_k) == base
    assert (folder / "model.safetensors").resolve() == (shipped / "model.safetensors").resolve()
