"""Exact acceptance probabilities of speculative sampling, for diagnostics.

A draft token d ~ q is kept with probability min(1, p(d) / q(d)), so a slot is accepted
with probability alpha = sum_x q(x) min(1, p(x) / q(x)) = sum_x min(p(x), q(x))
= 1 - TV(p, q) (Leviathan et al. 2023, Theorem 3.5). No sampling is involved.

Over a block, with alpha_i the acceptance probability of slot i given the slots before it
were accepted, the expected tokens per verify pass (bonus included) is
    E[tokens] = 1 + sum_k prod_{i <= k} alpha_i,
the chain rule of the speculative decoding papers. Diagnostics evaluate alpha_i
teacher-forced (the true prefix as context), an approximation: the engine's prefix is the
accepted drafts, which follow min(p, q) / alpha rather than p.

Shape legend: N blocks (any leading axes), S drafted slots, C candidates, V vocab.
"""

from __future__ import annotations

import jax.numpy as jnp


def overlap(p, q):
    """alpha = sum_x min(p(x), q(x)): p, q [..., V] -> [...]."""
    return jnp.sum(jnp.minimum(p, q), -1)


def overlap_sparse(p, ids, q):
    """alpha for q supported on distinct ids: p [..., V]; ids, q [..., C] -> [...]."""
    return jnp.sum(jnp.minimum(jnp.take_along_axis(p, ids, -1), q), -1)


def spliced_overlap(p, ids, q_ids, q_outside):
    """alpha of the q that is q_ids on the distinct ids and q_outside everywhere else
    (q_outside's own values at the ids are ignored), without building it.
    p, q_outside [..., V]; ids, q_ids [..., C] -> [...]."""
    p_ids = jnp.take_along_axis(p, ids, -1)                               # [..., C]
    out_ids = jnp.take_along_axis(q_outside, ids, -1)
    return (overlap(p, q_outside) - jnp.sum(jnp.minimum(p_ids, out_ids), -1)
            + jnp.sum(jnp.minimum(p_ids, q_ids), -1))


def mixture_overlap(p, ids, q_sparse, q_dense, weight):
    """alpha of q = (1 - w) * q_sparse (on distinct ids) + w * q_dense.
    p, q_dense [..., V]; ids, q_sparse [..., C]; weight: a float -> [...]."""
    dense_ids = jnp.take_along_axis(q_dense, ids, -1)
    return spliced_overlap(p, ids, (1 - weight) * q_sparse + weight * dense_ids,
                           weight * q_dense)


def expected_tokens(alpha):
    """Tokens per verify pass: alpha [..., S] -> 1 + sum_k prod_{i <= k} alpha_i [...]."""
    return 1.0 + jnp.sum(jnp.cumprod(alpha, -1), -1)
