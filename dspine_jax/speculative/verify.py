"""The verification rule: which drafted tokens the target keeps, and the token it adds.

Speculative sampling (Leviathan et al.; Chen et al.): draft token d_i (from q_i) is kept
with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the target samples
from norm(max(0, p_i - q_i)); if every draft is kept it samples a bonus token from the
next p. The output then follows p exactly.

Greedy decoding is the same rule with one-hot p (the target's argmax) and one-hot q (the
draft): keep while d_i equals the target's choice, then emit the target's choice. So one
code path serves T = 0 and T > 0, row by row.

`verify` takes dense p [B, K, V] and q [B, K-1, V] (the original path). `verify_logits`
takes the target's logits and any proposal (`dspine_jax/speculative/propose.py`) and
builds no warped [B, K, V] p nor any [B, K-1, V] q: T = 0 rows are an argmax comparison
(no softmax at all; an all-greedy batch traces nothing else); at T > 0 the warp's
threshold and normaliser per position come from `warp_stats` (a partial top-k, no sort),
p of the drafted tokens is read off the logits, and p and q are built in full for one
row per batch row: the one the residual or the bonus token is drawn from.

Shape legend: B batch, K block size (anchor + K - 1 drafts), S = K - 1, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dspine_jax import row_keys
from dspine_jax.sampling import (SamplingParams, first_argmax, greedy_rows_argmax,
                                 sample_categorical, warp_stats, warped_probability)


@struct.dataclass
class Verdict:
    num_accepted: jax.Array  # [B] drafts kept, 0 .. K-1
    next_token: jax.Array    # [B] the target's token after them (correction or bonus)


def residual(p: jax.Array, q: jax.Array) -> jax.Array:
    """norm(max(0, p - q)) over the last axis; falls back to p where p <= q everywhere
    (then no rejection can have happened, but the value must stay a distribution)."""
    r = jnp.maximum(p - q, 0.0)
    total = jnp.sum(r, -1, keepdims=True)
    return jnp.where(total > 0, r / jnp.maximum(total, 1e-30), p)


def verify(draft_tokens: jax.Array, q: jax.Array, p: jax.Array, rng: jax.Array) -> Verdict:
    """draft_tokens [B, K-1]; q [B, K-1, V] the drafter's distributions they came from;
    p [B, K, V] the target's distributions after the anchor and after each draft."""
    b, n = draft_tokens.shape
    p_draft = jnp.take_along_axis(p[:, :-1], draft_tokens[..., None], -1)[..., 0]
    q_draft = jnp.take_along_axis(q, draft_tokens[..., None], -1)[..., 0]
    accept_key, sample_key = row_keys.split(rng, 2)
    u = row_keys.uniform(accept_key, (b, n))
    # u < p/q, written without division (q_draft > 0 for any token q could draft).
    kept = u * q_draft < p_draft
    num_accepted = jnp.sum(jnp.cumprod(kept.astype(jnp.int32), axis=1), axis=1)
    rows = jnp.arange(b)
    p_next = p[rows, num_accepted]                                      # [B, V]
    q_next = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], 1)[rows, num_accepted]
    all_kept = (num_accepted == n)[:, None]
    dist = jnp.where(all_kept, p_next, residual(p_next, q_next))
    next_token = row_keys.categorical(sample_key, jnp.log(dist)).astype(jnp.int32)
    return Verdict(num_accepted=num_accepted.astype(jnp.int32), next_token=next_token)


def _accepted_prefix(kept: jax.Array) -> jax.Array:
    return jnp.sum(jnp.cumprod(kept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def verify_logits(proposal, logits: jax.Array, sampling: SamplingParams,
                  rng: jax.Array) -> Verdict:
    """The same rule as `verify`, from the target's logits [B, K, V] and a proposal
    (tokens [B, S], `token_q()` [B, S], `q_row(n)` [B, V])."""
    tokens = proposal.tokens
    b, n = tokens.shape
    rows = jnp.arange(b)
    if sampling.all_greedy:
        greedy = first_argmax(logits)                                  # [B, K]
        num_accepted = _accepted_prefix(tokens == greedy[:, :-1])
        return Verdict(num_accepted=num_accepted, next_token=greedy[rows, num_accepted])
    greedy = greedy_rows_argmax(logits, sampling)
    greedy_kept = tokens == greedy[:, :-1]
    scaled, tau, log_norm = warp_stats(logits, sampling)               # [B,K,V], [B,K], [B,K]
    x_draft = jnp.take_along_axis(scaled[:, :-1], tokens[..., None], -1)[..., 0]
    p_draft = warped_probability(x_draft, tau[:, :-1], log_norm[:, :-1])
    q_draft = proposal.token_q()
    accept_key, sample_key = row_keys.split(rng, 2)
    u = row_keys.uniform(accept_key, (b, n))
    hot = sampling.temperature > 0
    # u < p/q, written without division (q_draft > 0 for any token q could draft).
    kept = jnp.where(hot[:, None], u * q_draft < p_draft, greedy_kept)
    num_accepted = _accepted_prefix(kept)
    p_next = warped_probability(scaled[rows, num_accepted], tau[rows, num_accepted, None],
                                log_norm[rows, num_accepted, None])     # [B, V]
    q_next = proposal.q_row(num_accepted)                              # [B, V], 0 for the bonus
    all_kept = (num_accepted == n)[:, None]
    dist = jnp.where(all_kept, p_next, residual(p_next, q_next))
    drawn = sample_categorical(dist, sample_key)
    next_token = jnp.where(hot, drawn, greedy[rows, num_accepted])
    return Verdict(num_accepted=num_accepted, next_token=next_token.astype(jnp.int32))
