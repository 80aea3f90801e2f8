"""lm_head_stats in plain JAX with the full logits: the documentation of what the other
implementations compute, and the dense path of the training loss.

R rows, D hidden, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def label_logits(hidden, weight, labels):
    """[R] float32: each row's logit of its label, hidden . weight[label] (weight in
    hidden's dtype, products accumulated in float32, as the full logits)."""
    rows = jnp.take(weight, labels, axis=0).astype(hidden.dtype)
    return jnp.einsum("RD,RD->R", hidden, rows, preferred_element_type=jnp.float32,
                      precision=_precision(hidden))


def vocab_logits(hidden, weight):
    """hidden [R, D], weight [V, D] -> logits [R, V] float32."""
    return jnp.einsum("RD,VD->RV", hidden, weight.astype(hidden.dtype),
                      preferred_element_type=jnp.float32, precision=_precision(hidden))


def count_before(logits, ids, value, labels):
    """[R] int32: entries of logits [R, N] (vocabulary ids [N] or [R, N]) that lax.top_k
    puts before a label of logit `value` [R]: greater, or equal at a lower id. The label's
    own entry never counts (its logit here may round differently from `value`)."""
    value, labels = value[:, None], labels[:, None]
    before = (logits > value) | ((logits == value) & (ids < labels))
    return jnp.sum(before & (ids != labels), axis=-1, dtype=jnp.int32)


def lm_head_stats_reference(hidden, weight, labels):
    """(lse [R], label_logit [R], rank [R] int32) of logits = hidden @ weight^T, by building
    the [R, V] logits; differentiable by plain autodiff."""
    logits = vocab_logits(hidden, weight)
    value = label_logits(hidden, weight, labels)
    rank = count_before(jax.lax.stop_gradient(logits), jnp.arange(weight.shape[0]),
                        jax.lax.stop_gradient(value), labels)
    return jax.nn.logsumexp(logits, axis=-1), value, rank


def _precision(x):
    return jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
