"""lm_head_stats in plain JAX, one block of vocabulary columns at a time.

R rows, D hidden, V vocab, N chunk (vocabulary columns per step), n = ceil(V / N).

Both passes run under lax.scan over the n chunks of the lm_head, so at most one [R, N]
block of logits exists at a time: the forward keeps a running max, sum of exponentials
and count before the label per row; the backward recomputes each block's logits and adds
softmax(block) * g_lse @ weight(block) into d hidden (a second product instead of storing
the [R, V] logits or their gradient). Columns past V (the last chunk's padding) are -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import _precision, count_before, vocab_logits


def _chunks(weight, chunk: int):
    """weight [V, D] -> ([n, N, D] zero-padded, first vocabulary id of each chunk [n])."""
    v, d = weight.shape
    chunk = min(chunk, v)
    n = -(-v // chunk)
    padded = jnp.pad(weight, ((0, n * chunk - v), (0, 0))).reshape(n, chunk, d)
    return padded, jnp.arange(n, dtype=jnp.int32) * chunk


def _block(hidden, rows, start, vocab: int):
    """Logits [R, N] of one chunk, -inf past V, and the chunk's ids [N]."""
    ids = start + jnp.arange(rows.shape[0], dtype=jnp.int32)
    logits = vocab_logits(hidden, rows)
    return jnp.where(ids < vocab, logits, -jnp.inf), ids


def forward_xla(hidden, weight, labels, value, chunk: int):
    """(lse [R], rank [R] int32); value [R] is the labels' logits."""
    vocab = weight.shape[0]
    r = hidden.shape[0]

    def step(carry, xs):
        top, total, count = carry
        logits, ids = _block(hidden, *xs, vocab)
        new_top = jnp.maximum(top, jnp.max(logits, axis=-1))       # finite after chunk 0
        total = total * jnp.exp(top - new_top) + jnp.sum(jnp.exp(logits - new_top[:, None]),
                                                         axis=-1)
        return (new_top, total, count + count_before(logits, ids, value, labels)), None

    init = (jnp.full((r,), -jnp.inf, jnp.float32), jnp.zeros((r,), jnp.float32),
            jnp.zeros((r,), jnp.int32))
    (top, total, count), _ = jax.lax.scan(step, init, _chunks(weight, chunk))
    return top + jnp.log(total), count


def backward_xla(hidden, weight, labels, lse, g_lse, g_value, chunk: int):
    """d hidden [R, D] (hidden's dtype) of lse and label_logit, given their cotangents."""
    vocab = weight.shape[0]
    dtype = hidden.dtype

    def step(acc, xs):
        rows, _ = xs
        logits, _ = _block(hidden, *xs, vocab)
        grad = jnp.exp(logits - lse[:, None]) * g_lse[:, None]           # [R, N]
        return acc + jnp.einsum("RN,ND->RD", grad.astype(dtype), rows.astype(dtype),
                                preferred_element_type=jnp.float32,
                                precision=_precision(hidden)), None

    acc, _ = jax.lax.scan(step, jnp.zeros(hidden.shape, jnp.float32), _chunks(weight, chunk))
    acc = acc + g_value[:, None] * jnp.take(weight, labels, axis=0).astype(dtype).astype(
        jnp.float32)
    return acc.astype(dtype)
