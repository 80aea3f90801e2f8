"""The sparse verification path: the warp without a vocabulary sort, the rule from the
target's logits and a sparse proposal, and the engine's dense path still selectable.

The distribution tests compute, in float64, the exact law of (accepted drafts, next token)
that speculative sampling must produce for a fixed block, and chi-square the sampled
verdicts of many identical rows against it."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from dspine_jax.sampling import (THRESHOLD_IMPLEMENTATIONS, SamplingParams,
                                 sample_categorical, warp_logits, warp_stats, warp_threshold,
                                 warped_probability)
from dspine_jax.speculative.propose import (CandidateProposal, Proposal, sample_marginal)
from dspine_jax.speculative.verify import verify_logits
from dspine_jax.runtime.offline import generate_tokens
from pallas_kernels.warp_threshold import warp_threshold as threshold_rows
from tests.test_sampling import reference_probs

WARPS = [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.5, 0.5, 10), (1.0, 0.3, 3),
         (2.0, 0.95, 1), (3.0, 0.999, 0), (1.0, 1.0, 300)]


WARP_PATHS = ["selection", "sort", "search", "pallas"]


def use_warp_path(monkeypatch, path: str) -> bool:
    """Make `warp_threshold` find its set one way: the CPU's partial top-k and bisection
    ("selection"), or with no data-dependent control flow as on a GPU, by a sort of the
    vocabulary ("sort"), the sort-free search in XLA ("search") or in the Pallas kernel,
    interpreted ("pallas"): the values of the warp_threshold switch.
    Returns whether the path is branch-free."""
    monkeypatch.setattr("dspine_jax.sampling.branch_free", lambda: path != "selection")
    implementation = THRESHOLD_IMPLEMENTATIONS.get(path, "sort")
    monkeypatch.setattr("dspine_jax.sampling.gpu_threshold_implementation",
                        lambda: implementation)
    monkeypatch.setattr("dspine_jax.sampling.threshold_rows", functools.partial(
        threshold_rows, interpret=implementation == "pallas_gpu"))
    return path != "selection"


@pytest.fixture(params=WARP_PATHS)
def branch_free(request, monkeypatch):
    return use_warp_path(monkeypatch, request.param)


@pytest.mark.parametrize("caps", [(64, 1024), (4, 16), (2,)], ids=["default", "small", "tiny"])
@pytest.mark.parametrize("warp", WARPS, ids=[str(w) for w in WARPS])
def test_warp_threshold_keeps_what_warp_logits_keeps(warp, caps, branch_free):
    """Same kept set as the sorting warp (whichever cap decides it, or the fallback sort);
    probabilities within float32 rounding of float64 numpy."""
    if branch_free and caps != (64, 1024):
        pytest.skip("the branch-free path has no caps")
    t, p, k = warp
    logits = np.random.default_rng(0).normal(size=(3, 4, 400)) * 3
    params = SamplingParams.create(3, t, p, k)
    scaled = jnp.asarray(logits / t, jnp.float32)
    tau = warp_threshold(scaled, params, caps)
    kept = np.asarray(scaled >= tau[..., None])
    if p < 1:   # warp_logits at top_p = 1 can drop a tail that rounds away; we keep it
        want = np.isfinite(np.asarray(warp_logits(jnp.asarray(logits, jnp.float32), params)))
        np.testing.assert_array_equal(kept, want)
    sc, tau, log_norm = warp_stats(jnp.asarray(logits, jnp.float32), params)
    got = np.asarray(warped_probability(sc, tau[..., None], log_norm[..., None]))
    for i in np.ndindex(3, 4):
        np.testing.assert_allclose(got[i], reference_probs(logits[i], t, p, k), atol=2e-6)


def test_warp_threshold_skips_greedy_and_unfiltered_rows(branch_free):
    params = SamplingParams(jnp.asarray([0.0, 1.0, 0.5]), jnp.asarray([0.5, 1.0, 1.0]),
                            jnp.asarray([3, 0, 0], jnp.int32))
    tau = warp_threshold(jnp.asarray(np.random.default_rng(1).normal(size=(3, 50)),
                                     jnp.float32), params)
    assert np.all(np.isneginf(np.asarray(tau)))


@pytest.mark.parametrize("block", [256, 3, 2])
def test_sample_categorical_follows_the_probabilities(block):
    probs = np.array([0.0, 0.1, 0.0, 0.45, 0.05, 0.4, 0.0])
    draws = np.asarray(sample_categorical(jnp.broadcast_to(jnp.asarray(probs * 3, jnp.float32),
                                                           (20000, 7)), jax.random.key(0),
                                          block))
    assert set(np.unique(draws)) <= {1, 3, 4, 5}
    counts = np.bincount(draws, minlength=7)[probs > 0]
    assert chisquare(counts, probs[probs > 0] * 20000).pvalue > 1e-4


# ----- the rule ----------------------------------------------------------------------------------
V, S = 9, 3


def exact_verdict_law(p, q, tokens):
    """Float64 law of (n, next) for one block: p [S+1, V] warped target distributions,
    q [S, V] the drafter's, tokens [S]. Returns [S+1, V]."""
    law = np.zeros((S + 1, V))
    survive = 1.0
    for j in range(S + 1):
        if j == S:
            law[j] = survive * p[S]
            break
        a = min(1.0, p[j, tokens[j]] / q[j, tokens[j]])
        resid = np.maximum(p[j] - q[j], 0)
        law[j] = survive * (1 - a) * (resid / resid.sum() if resid.sum() > 0 else p[j])
        survive *= a
    return law


def sampled_verdicts(proposal_fn, logits, sampling, rows=20000, seed=0):
    batch = lambda x: jnp.broadcast_to(x, (rows,) + x.shape)  # noqa: E731
    proposal = proposal_fn(batch)
    verdict = jax.jit(verify_logits)(proposal, batch(logits), sampling, jax.random.key(seed))
    counts = np.zeros((S + 1, V))
    np.add.at(counts, (np.asarray(verdict.num_accepted), np.asarray(verdict.next_token)), 1)
    return counts


def chi2(counts, law):
    expected = law.ravel() * counts.sum()
    assert counts.ravel()[expected == 0].sum() == 0, "an impossible verdict was sampled"
    keep = expected > 5
    obs = np.append(counts.ravel()[keep], counts.ravel()[~keep & (expected > 0)].sum())
    exp = np.append(expected[keep], expected[~keep & (expected > 0)].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def warped64(logits, warp):
    return np.stack([reference_probs(row, *warp) for row in np.asarray(logits, np.float64)])


# The interpreted kernel finds the search's threshold (the tests above); under the sampling
# loop here it would take minutes of CPU, so its law is the search's.
@pytest.mark.parametrize("path", [p for p in WARP_PATHS if p != "pallas"])
@pytest.mark.parametrize("warp", [(1.0, 1.0, 0), (0.8, 0.9, 6)], ids=["T1", "T0.8-p0.9-k6"])
def test_rule_with_a_marginal_proposal_has_the_exact_law(warp, path, monkeypatch):
    if warp[1:] == (1.0, 0) and path != "selection":
        pytest.skip("an unfiltered warp has no threshold to find")
    use_warp_path(monkeypatch, path)
    rng = np.random.default_rng(7)
    target_logits = jnp.asarray(rng.normal(size=(S + 1, V)) * 1.5, jnp.float32)
    draft_logits = jnp.asarray(rng.normal(size=(S, V)) * 1.5, jnp.float32)
    tokens = np.asarray(jnp.argsort(-draft_logits, -1)[:, 1])   # the drafter's 2nd choice
    rows = 20000
    sampling = SamplingParams.create(rows, *warp)

    def proposal(batch):
        prop = sample_marginal(batch(draft_logits), sampling, jax.random.key(1))
        # fix the drafted tokens (and their q) so the law is one block's law
        toks = batch(jnp.asarray(tokens))
        q_tok = jnp.take_along_axis(prop.dense_q(), toks[..., None], -1)[..., 0]
        return prop.replace(tokens=toks, q_tokens=q_tok)

    counts = sampled_verdicts(proposal, target_logits, sampling, rows)
    law = exact_verdict_law(warped64(target_logits, warp), warped64(draft_logits, warp), tokens)
    assert chi2(counts, law) > 1e-4


def test_rule_with_a_candidate_proposal_has_the_exact_law():
    rng = np.random.default_rng(8)
    target_logits = jnp.asarray(rng.normal(size=(S + 1, V)) * 1.5, jnp.float32)
    cands = np.stack([rng.permutation(V)[:4] for _ in range(S)])
    probs = rng.dirichlet(np.ones(4), size=S)
    tokens = cands[np.arange(S), np.argmax(probs, -1)]
    q = np.zeros((S, V))
    q[np.arange(S)[:, None], cands] = probs
    rows = 20000
    sampling = SamplingParams.create(rows, 1.0)

    def proposal(batch):
        f = lambda x, dt: batch(jnp.asarray(x, dt))  # noqa: E731
        return CandidateProposal(tokens=f(tokens, jnp.int32),
                                 q_tokens=f(q[np.arange(S), tokens], jnp.float32),
                                 candidates=f(cands, jnp.int32), q=f(probs, jnp.float32),
                                 vocab_size=V)

    counts = sampled_verdicts(proposal, target_logits, sampling, rows)
    law = exact_verdict_law(warped64(target_logits, (1.0, 1.0, 0)), q, tokens)
    assert chi2(counts, law) > 1e-4


def test_greedy_rule_is_an_argmax_comparison_with_no_softmax():
    v = 6
    drafts = jnp.asarray([[2, 3, 4], [2, 3, 4], [2, 3, 4]])
    greedy = jnp.asarray([[2, 3, 4, 5], [2, 5, 4, 1], [1, 3, 4, 0]])  # target's argmax
    logits = jax.nn.one_hot(greedy, v) * 5.0
    sampling = SamplingParams.create(3, 0.0)
    prop = Proposal(tokens=drafts, q=jax.nn.one_hot(drafts, v))
    verdict = verify_logits(prop, logits, sampling, jax.random.key(0))
    assert verdict.num_accepted.tolist() == [3, 1, 0]
    assert verdict.next_token.tolist() == [5, 5, 1]   # bonus, correction, correction
    hlo = jax.jit(verify_logits, static_argnums=()).lower(
        prop, logits, sampling, jax.random.key(0)).compile().as_text()
    assert not re.search(r"\b(exponential|sort)\(", hlo)
    # Mixed batch: greedy rows still compare argmaxes.
    mixed = SamplingParams(jnp.asarray([0.0, 1.0, 0.0]), jnp.ones(3), jnp.zeros(3, jnp.int32))
    verdict = verify_logits(prop, logits * 10, mixed, jax.random.key(0))
    assert verdict.num_accepted[0] == 3 and verdict.num_accepted[2] == 0
    assert verdict.next_token[0] == 5 and verdict.next_token[2] == 1


# ----- the engine: the dense path stays selectable; the sparse path sorts no vocabulary ----
@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_dense_engine_still_equals_autoregressive_at_t0(kind):
    """(The sparse engine, the default, is checked by tests/test_engine.py.)"""
    from dspine_jax.engine import SpeculativeEngine
    from dspine_jax.generate import AutoregressiveGenerator
    from tests.test_engine import PROMPTS, build

    target, drafter = build(kind=kind)
    prompts = PROMPTS[:4]
    want = generate_tokens(AutoregressiveGenerator(target, eos_token_ids=[0]),
        prompts, max_new_tokens=16).generations
    engine = SpeculativeEngine(target, drafter, eos_token_ids=[0], steps_per_call=3,
                               proposal_impl="dense")
    got = generate_tokens(engine, prompts, max_new_tokens=16).generations
    assert [g.tokens for g in got] == [w.tokens for w in want]


def test_unknown_proposal_impl_is_refused():
    from dspine_jax.engine import SpeculativeEngine
    from tests.test_engine import build

    target, drafter = build(kind="dflash")
    with pytest.raises(ValueError, match="proposal implementation"):
        SpeculativeEngine(target, drafter, proposal_impl="fast")


def _vocab_sorts(fn, *args, vocab):
    """Sorts of vocabulary-sized operands in the compiled ENTRY computation (a cond's
    fallback branch is a separate computation and does not count)."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    return [line for line in entry.splitlines() if " sort(" in line and f",{vocab}]" in line]


def test_sampled_sparse_path_sorts_no_vocabulary():
    """At T = 0.8 / top-p 0.9: the DFlash proposal and the verification sort nothing
    vocabulary-sized on their common path; the dense warp does."""
    if jax.default_backend() != "cpu":
        pytest.skip("the lowering checked here is XLA CPU's")
    vocab, b = 3000, 2
    rng = np.random.default_rng(0)
    draft = jnp.asarray(rng.normal(size=(b, S, vocab)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(b, S + 1, vocab)), jnp.float32)
    sampling = SamplingParams.create(b, 0.8, 0.9)
    key = jax.random.key(0)
    assert _vocab_sorts(lambda x: warp_logits(x, sampling), target, vocab=vocab)
    assert not _vocab_sorts(lambda x: sample_marginal(x, sampling, key), draft, vocab=vocab)
    proposal = sample_marginal(draft, sampling, key)
    assert not _vocab_sorts(lambda p, x: verify_logits(p, x, sampling, key), proposal, target,
                            vocab=vocab)


def test_sort_free_search_traces_no_sort_and_no_loop(monkeypatch):
    """DSPINE_WARP_THRESHOLD=search on the branch-free path: the threshold of a top-p/top-k warp
    with no vocabulary sort and no while loop (a loop step would wait on the host on a
    GPU), and the same kept set as the sort on exact ties."""
    vocab = 3000
    logits = jnp.asarray(np.random.default_rng(3).integers(-4, 4, size=(2, 3, vocab)),
                         jnp.float32)
    for top_k in (0, 40, 2999):
        sampling = SamplingParams.create(2, 0.8, 0.9, top_k)
        fn = lambda x: warp_threshold(x, sampling)  # noqa: E731
        use_warp_path(monkeypatch, "search")
        assert not _vocab_sorts(fn, logits, vocab=vocab)
        assert " while(" not in jax.jit(fn).lower(logits).compile().as_text()
        got = np.asarray(fn(logits))
        use_warp_path(monkeypatch, "sort")
        np.testing.assert_array_equal(got, np.asarray(fn(logits)))   # the same value
