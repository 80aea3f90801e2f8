"""The definition of a top-k/top-p warp's threshold, by a sort of each row.

Rows of temperature-scaled logits x [R, V] with per-row k [R] (V: no top-k) and top_p [R]
(1: no top-p). Order follows transformers: keep the k largest entries, then, over the
softmax of what top-k kept, keep entries in descending order while the mass before each
is below top_p (the first always stays). The kept set is {v : x_v >= tau}: ties with the
last kept value are all kept.

R rows, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def warp_threshold_reference(scaled: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """scaled [R, V] float32, k [R] int32 in 1..V, top_p [R] float32 in (0, 1] ->
    tau [R] float32, the smallest kept value of each row."""
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)                          # [R, V]
    rank = jnp.arange(vocab)
    in_k = rank[None, :] < k[:, None]
    sorted_desc = jnp.where(in_k, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    keep = ((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]) & in_k
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    return jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)[:, 0]
