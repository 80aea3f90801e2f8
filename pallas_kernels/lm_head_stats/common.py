"""Checks shared by every implementation of `lm_head_stats`, and the combine of per-split
partial statistics.

R rows, D hidden, V vocab, S vocabulary splits.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..vocab_tiles import check_hidden_weight

OP = "lm_head_stats"
IMPLEMENTATIONS = ("auto", "xla", "pallas_tpu", "pallas_gpu")


def check_inputs(hidden, weight, labels, implementation, chunk) -> None:
    """Raises ValueError at trace time (shapes and dtypes only)."""
    def fail(what):
        raise ValueError(f"{OP}: {what}")

    if implementation not in IMPLEMENTATIONS:
        fail(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    check_hidden_weight(OP, hidden, weight)
    if labels.shape != hidden.shape[:1] or not jnp.issubdtype(labels.dtype, jnp.integer):
        fail(f"labels must be [R] = [{hidden.shape[0]}] integers, got {labels.shape} "
             f"{labels.dtype}")
    if not isinstance(chunk, int) or chunk < 1:
        fail(f"chunk must be a positive int, got {chunk!r}")


def combine(maxes, sums, counts):
    """Partials [S, R] (each split's max, sum of exp(logit - max), count before the
    label) -> (lse [R], count [R] int32)."""
    top = jnp.max(maxes, axis=0)
    safe = jnp.where(jnp.isfinite(top), top, 0.0)
    total = jnp.sum(sums * jnp.exp(maxes - safe), axis=0)
    return safe + jnp.log(total), jnp.sum(counts, axis=0, dtype=jnp.int32)
