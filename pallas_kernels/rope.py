"""Rotary position embeddings in HF's half-split layout: the one rule that the attention op,
its kernels' references and the models (`dspine_jax.rope.apply_rope`) rotate by.

B batch rows, T tokens, H head dim; any head axes between T and H.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rotate_half_split(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, ..., H] rotated by cos, sin [B, T, H/2] float32 (scaling folded in):
    [x1 cos - x2 sin, x2 cos + x1 sin] of x's halves x1, x2; float32 math, x's dtype out."""
    heads = (None,) * (x.ndim - 3)
    cos, sin = cos[(slice(None), slice(None), *heads)], sin[(slice(None), slice(None), *heads)]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
