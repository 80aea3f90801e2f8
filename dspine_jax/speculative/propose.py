"""What a drafter proposes: draft tokens, the probability q each had under the drafter's
own (warped) distribution, and what verification needs to sample a residual.

The engine never looks inside a drafter: it asks `drafter.proposer(impl)` for a
`Proposer` and gets back one of the proposals below. Verification reads a proposal only
through three calls:

  token_q()    [B, S]  q_i(d_i) of each drafted token (1 at greedy rows)
  q_row(n)     [B, V]  the whole q of slot n[b] (zeros for n = S: the bonus row), needed
                       once per row for the residual norm(max(0, p - q))
  dense_q()    [B, S, V] every q (the dense path, tests and diagnostics)

Three kinds:
  Proposal           dense q [B, S, V] (the original path; tests' hand-built drafts)
  CandidateProposal  q supported on C candidates per slot (DSpine's decoding head):
                     ids [B, S, C] and their probabilities, zero elsewhere
  MarginalProposal   q = softmax(warp(logits)) of each slot's own logits (DFlash): the
                     logits plus the warp's threshold and log-normaliser per slot, so any
                     one row of q is rebuilt on demand and nothing [S, V] is built
  SplicedProposal    DSpine's head with its base marginal's tail (`marginal_tail`): the
                     candidates' q, and the marginal's logits and warp stats for the rest
DSpine's whole-vocabulary chain (`vocabulary_chain`) is a `MarginalProposal` whose logits
are each slot's given the drafted predecessor (`walk_vocabulary_chain`).

The functions here work on arrays only (`sample_marginal`, `walk_chain`,
`walk_chain_with_tail`, and `walk_vocabulary_chain`, which takes the head as a function);
which drafter computes which arrays lives in `dspine_jax/drafters/proposers.py`.

Shape legend: B batch, K block size, S = K - 1 drafted slots, C candidates, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import struct

from dspine_jax import row_keys
from dspine_jax.sampling import (SamplingParams, first_argmax, greedy_rows_argmax,
                                 sample_categorical, warp_logits, warp_stats,
                                 warped_probability)
from pallas_kernels.dspine_proposal.reference import (follow_chain, predecessor_rows,
                                                       walk_at_once)


def _pick_row(x: jax.Array, n: jax.Array) -> jax.Array:
    """x [B, S, ...] -> x[b, n[b]] [B, ...], zeros where n[b] == S (past the last slot)."""
    s = x.shape[1]
    row = jnp.take_along_axis(x, jnp.minimum(n, s - 1).reshape((-1, 1) + (1,) * (x.ndim - 2)),
                              axis=1)[:, 0]
    return jnp.where((n < s).reshape((-1,) + (1,) * (x.ndim - 2)), row, 0)


@struct.dataclass
class Proposal:
    tokens: jax.Array  # [B, S] drafted tokens for slots 1 .. K-1
    q: jax.Array       # [B, S, V] the distribution each was drawn from (one-hot at T = 0)

    def token_q(self) -> jax.Array:
        return jnp.take_along_axis(self.q, self.tokens[..., None], -1)[..., 0]

    def q_row(self, n: jax.Array) -> jax.Array:
        return _pick_row(self.q, n)

    def dense_q(self) -> jax.Array:
        return self.q


@struct.dataclass
class CandidateProposal:
    tokens: jax.Array      # [B, S]
    q_tokens: jax.Array    # [B, S] q of each drafted token
    candidates: jax.Array  # [B, S, C] token ids q is supported on (distinct per slot)
    q: jax.Array           # [B, S, C] their probabilities (one-hot at greedy rows)
    vocab_size: int = struct.field(pytree_node=False, default=0)

    def token_q(self) -> jax.Array:
        return self.q_tokens

    def q_row(self, n: jax.Array) -> jax.Array:
        ids, probs = _pick_row(self.candidates, n), _pick_row(self.q, n)      # [B, C]
        rows = jnp.arange(ids.shape[0])[:, None]
        return jnp.zeros((ids.shape[0], self.vocab_size), jnp.float32).at[rows, ids].add(probs)

    def dense_q(self) -> jax.Array:
        b, s, _ = self.candidates.shape
        return jnp.zeros((b, s, self.vocab_size), jnp.float32).at[
            jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None], self.candidates].add(self.q)


@struct.dataclass
class MarginalProposal:
    tokens: jax.Array       # [B, S]
    q_tokens: jax.Array     # [B, S]
    logits: jax.Array       # [B, S, V] each slot's own logits (the drafter's, not a copy)
    sampling: SamplingParams
    tau: jax.Array | None       # [B, S] warp threshold of the scaled logits (None: greedy)
    log_norm: jax.Array | None  # [B, S] log-normaliser over the kept tokens

    def token_q(self) -> jax.Array:
        return self.q_tokens

    def _greedy(self) -> bool:
        return self.tau is None

    def q_row(self, n: jax.Array) -> jax.Array:
        vocab = self.logits.shape[-1]
        hot = jax.nn.one_hot(_pick_row(self.tokens, n), vocab) * (n < self.tokens.shape[1])[:, None]
        if self._greedy():
            return hot
        t = jnp.where(self.sampling.temperature > 0, self.sampling.temperature, 1.0)
        scaled = _pick_row(self.logits, n).astype(jnp.float32) / t[:, None]
        probs = warped_probability(scaled, _pick_row(self.tau, n)[:, None],
                                   _pick_row(self.log_norm, n)[:, None])
        probs = jnp.where((n < self.tokens.shape[1])[:, None], probs, 0.0)
        return jnp.where((self.sampling.temperature > 0)[:, None], probs, hot)

    def dense_q(self) -> jax.Array:
        vocab = self.logits.shape[-1]
        hot = jax.nn.one_hot(self.tokens, vocab)
        if self._greedy():
            return hot
        t = jnp.where(self.sampling.temperature > 0, self.sampling.temperature, 1.0)
        probs = warped_probability(self.logits.astype(jnp.float32) / t[:, None, None],
                                   self.tau[..., None], self.log_norm[..., None])
        return jnp.where((self.sampling.temperature > 0)[:, None, None], probs, hot)


@struct.dataclass
class SplicedProposal:
    """DSpine's head with the base marginal's tail: q is `q` on each slot's C candidates
    and the marginal's warped softmax everywhere else (greedy rows: one-hot on the
    candidates, no tail). The tail is the marginal's own `MarginalProposal` (its logits and
    warp statistics), so nothing [S, V] is kept beyond the drafter's logits."""
    tokens: jax.Array      # [B, S]
    q_tokens: jax.Array    # [B, S]
    candidates: jax.Array  # [B, S, C] distinct per slot
    q: jax.Array           # [B, S, C] q on the candidates
    tail: MarginalProposal  # the base marginal, sampled rows' warp (not all greedy)

    def token_q(self) -> jax.Array:
        return self.q_tokens

    def _hot(self, ndim: int) -> jax.Array:
        """Sampled rows, [B, 1, ...] to broadcast over ndim axes; greedy rows get no tail."""
        return (self.tail.sampling.temperature > 0).reshape((-1,) + (1,) * (ndim - 1))

    def q_row(self, n: jax.Array) -> jax.Array:
        tail = jnp.where(self._hot(2), self.tail.q_row(n), 0.0)                  # [B, V]
        ids, probs = _pick_row(self.candidates, n), _pick_row(self.q, n)    # [B, C]
        return tail.at[jnp.arange(ids.shape[0])[:, None], ids].set(probs)

    def dense_q(self) -> jax.Array:
        tail = jnp.where(self._hot(3), self.tail.dense_q(), 0.0)              # [B, S, V]
        b, s, _ = self.candidates.shape
        return tail.at[jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None],
                       self.candidates].set(self.q)


SLOT_FIELDS = ("tokens", "q_tokens", "candidates", "q", "logits", "tau", "log_norm")


def proposal_prefix(proposal, width: int):
    """The proposal of the first `width` slots only (the verify width): every per-slot
    array cut on its slot axis, so `q_row(width)` is the bonus row (zeros), as
    verification of a shorter block needs. Any proposal kind above."""
    if width == proposal.tokens.shape[1]:
        return proposal
    changes = {f.name: getattr(proposal, f.name)[:, :width]
               for f in dataclasses.fields(proposal)
               if f.name in SLOT_FIELDS and getattr(proposal, f.name) is not None}
    if getattr(proposal, "tail", None) is not None:
        changes["tail"] = proposal_prefix(proposal.tail, width)
    return proposal.replace(**changes)


class Proposer(Protocol):
    """What a drafter hands the engine: one drafter output -> a proposal."""

    def propose(self, out, anchor: jax.Array, output_embedding: jax.Array,
                sampling: SamplingParams, rng: jax.Array):
        ...


# ----- array-only building blocks --------------------------------------------------------
def sample_dense(logits: jax.Array, sampling: SamplingParams, rng: jax.Array):
    """The dense rule: per row, the argmax and its one-hot at T = 0, else a draw from the
    warped softmax and that whole softmax. logits [B, ..., V] -> (tokens, probs [..., V])."""
    if sampling.all_greedy:
        greedy = jnp.argmax(logits, -1)
        return greedy.astype(jnp.int32), jax.nn.one_hot(greedy, logits.shape[-1])
    warped = warp_logits(logits, sampling)
    probs = jax.nn.softmax(warped, -1)
    greedy = jnp.argmax(logits, -1)
    drawn = row_keys.categorical(rng, warped)
    hot = (sampling.temperature > 0).reshape((-1,) + (1,) * (logits.ndim - 2))
    choice = jnp.where(hot, drawn, greedy)
    probs = jnp.where(hot[..., None], probs, jax.nn.one_hot(greedy, logits.shape[-1]))
    return choice.astype(jnp.int32), probs


def sample_marginal(logits: jax.Array, sampling: SamplingParams,
                    rng: jax.Array) -> MarginalProposal:
    """Each slot from its own warped softmax, logits [B, S, V], nothing [S, V] built
    beyond one pass of exp/cumsum: the warp's threshold comes from a partial top-k
    (`warp_threshold`) and the draw is an inverse CDF (`sample_categorical`)."""
    if sampling.all_greedy:
        greedy = first_argmax(logits)
        return MarginalProposal(tokens=greedy, q_tokens=jnp.ones(greedy.shape, jnp.float32),
                                logits=logits, sampling=sampling, tau=None, log_norm=None)
    scaled, tau, log_norm = warp_stats(logits, sampling)
    probs = warped_probability(scaled, tau[..., None], log_norm[..., None])
    drawn = sample_categorical(probs, rng)
    greedy = greedy_rows_argmax(logits, sampling)
    hot = (sampling.temperature > 0)[:, None]
    tokens = jnp.where(hot, drawn, greedy)
    q_tokens = jnp.take_along_axis(probs, tokens[..., None], -1)[..., 0]
    return MarginalProposal(tokens=tokens, q_tokens=jnp.where(hot, q_tokens, 1.0),
                            logits=logits, sampling=sampling, tau=tau, log_norm=log_norm)


def scan_slots(step, init, xs):
    """`lax.scan` of a walk over the S drafted slots, unrolled: S is small and static, and
    a GPU while loop reads its predicate back on the host at every step."""
    return jax.lax.scan(step, init, xs, unroll=True)


def walk_chain(table: jax.Array, candidates: jax.Array, sampling: SamplingParams,
               rng: jax.Array):
    """DSpine's walk from the anchor over a transition table.

    table [B, S, C, C]: slot i's scores of its candidates (last axis) given each candidate
    of slot i-1 (slot 0: given the anchor, every row the same); candidates [B, S, C].
    At T = 0 the best-scoring successor, else a draw from softmax(warp(scores)) over the C
    candidates; drawn as `pallas_kernels.dspine_proposal.walk_chain` draws (every pick at
    once, then followed, or slot by slot: `walk_at_once`). Returns (tokens [B, S],
    choice [B, S] candidate index, q [B, S, C])."""
    if sampling.all_greedy or walk_at_once():
        picks, probs = sample_dense(table, sampling, rng)               # [B, S, C], [.., C]
        choice = follow_chain(picks)
        q = predecessor_rows(probs, choice)
    else:
        def step(pred_index, inputs):
            scores, key = inputs                                        # [B, C, C]
            given = jnp.take_along_axis(scores, pred_index[:, None, None], 1)[:, 0]
            choice, probs = sample_dense(given, sampling, key)
            return choice, (choice, probs)

        keys = row_keys.split(rng, table.shape[1])                      # [S] or [S, B]
        start = jnp.zeros((table.shape[0],), jnp.int32)                 # the anchor
        _, (choice, q) = scan_slots(step, start, (jnp.moveaxis(table, 1, 0), keys))
        choice, q = jnp.moveaxis(choice, 0, 1), jnp.moveaxis(q, 0, 1)
    tokens = jnp.take_along_axis(candidates, choice[..., None], -1)[..., 0]
    return tokens, choice, q


def walk_chain_with_tail(table: jax.Array, candidates: jax.Array, logits: jax.Array,
                         sampling: SamplingParams, chain_sampling: SamplingParams,
                         rng: jax.Array) -> SplicedProposal:
    """DSpine's walk with the base marginal's tail (sampled rows; greedy rows walk as
    `walk_chain` does).

    Slot i's q: the marginal m_i (warped by `sampling`) outside its candidates; on them,
    m_i's mass there times r_i, the chain's row of the drawn predecessor warped by
    `chain_sampling`, or m_i renormalised over the candidates when the predecessor is no
    candidate of slot i-1 (the table has no row for it). Drawn as: a token from m_i (all
    slots at once); if it is a candidate, a redraw from r_i. That is a draw from q_i.
    table [B, S, C, C], candidates [B, S, C], logits [B, S, V] the marginal's."""
    b, s, c = candidates.shape
    marginal_key, walk_key = row_keys.split(rng, 2)
    m = sample_marginal(logits, sampling, marginal_key)                 # tokens y [B, S]
    t = jnp.where(sampling.temperature > 0, sampling.temperature, 1.0)[:, None, None]
    scaled = jnp.take_along_axis(logits, candidates, -1).astype(jnp.float32) / t
    inside = warped_probability(scaled, m.tau[..., None], m.log_norm[..., None])  # [B, S, C]
    mass = jnp.sum(inside, -1)                                          # [B, S]
    fallback = jnp.where(mass[..., None] > 0, inside / jnp.maximum(mass, 1e-30)[..., None],
                         1.0 / c)
    y_in = jnp.any(candidates == m.tokens[..., None], -1)               # [B, S]
    hot = sampling.temperature > 0                                      # [B]

    def step(pred, xs):
        scores, cands, fall, mass_i, y, q_y, y_in_i, key = xs
        given = jnp.take_along_axis(scores, jnp.maximum(pred, 0)[:, None, None], 1)[:, 0]
        best = jnp.argmax(given, -1).astype(jnp.int32)                  # [B]
        chain = jax.nn.softmax(warp_logits(given, chain_sampling), -1)   # [B, C]
        r = jnp.where((pred >= 0)[:, None], chain, fall)
        pick = row_keys.categorical(key, jnp.log(r)).astype(jnp.int32)
        q_c = mass_i[:, None] * r
        take = lambda x, i: jnp.take_along_axis(x, i[:, None], 1)[:, 0]  # noqa: E731
        token = jnp.where(y_in_i, take(cands, pick), y)
        q_tok = jnp.where(y_in_i, take(q_c, pick), q_y)
        nxt = jnp.where(y_in_i, pick, -1)
        return (jnp.where(hot, nxt, best),
                (jnp.where(hot, token, take(cands, best)), jnp.where(hot, q_tok, 1.0),
                 jnp.where(hot[:, None], q_c, jax.nn.one_hot(best, c))))

    xs = (table, candidates, fallback, mass, m.tokens, m.q_tokens, y_in)
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in xs) + (row_keys.split(walk_key, s),)
    _, (tokens, q_tokens, q) = scan_slots(step, jnp.zeros((b,), jnp.int32), xs)
    tokens, q_tokens, q = (jnp.moveaxis(x, 0, 1) for x in (tokens, q_tokens, q))
    return SplicedProposal(tokens=tokens, q_tokens=q_tokens, candidates=candidates, q=q,
                           tail=m)


def walk_vocabulary_chain(slot_logits, states: jax.Array, anchor: jax.Array,
                          sampling: SamplingParams, rng: jax.Array) -> MarginalProposal:
    """DSpine's walk with each slot's row over the whole vocabulary: slot i is drawn from
    the warped softmax of slot_logits(states[:, i], its drawn predecessor) (slot 1: given
    the anchor), so q has no top-C cut. Greedy rows take that row's argmax.

    slot_logits(state [B, D], predecessor [B]) -> [B, V] float32; states [B, S, D];
    anchor [B]. The logits of the drawn path stay in the proposal ([B, S, V], as DFlash's
    own logits do), so verification rebuilds any one row of q from them."""
    keys = row_keys.split(rng, states.shape[1])                        # [S] or [S, B]

    def step(pred, xs):
        state, key = xs
        logits = slot_logits(state, pred)[:, None]                     # [B, 1, V]
        slot = sample_marginal(logits, sampling, key)
        fields = (slot.tokens, slot.q_tokens, logits, slot.tau, slot.log_norm)
        return slot.tokens[:, 0], tuple(x[:, 0] for x in fields)

    _, fields = scan_slots(step, anchor.astype(jnp.int32), (jnp.moveaxis(states, 1, 0), keys))
    tokens, q_tokens, logits, tau, log_norm = (jnp.moveaxis(x, 0, 1) for x in fields)
    return MarginalProposal(tokens=tokens, q_tokens=q_tokens, logits=logits,
                            sampling=sampling, tau=tau, log_norm=log_norm)


def propose(drafter, out, anchor, output_embedding, sampling, rng, impl: str = "dense"):
    """The drafter's own proposer (`drafter.proposer(impl)`), applied to one drafter output."""
    return drafter.proposer(impl).propose(out, anchor, output_embedding, sampling, rng)
