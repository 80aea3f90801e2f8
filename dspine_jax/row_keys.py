"""Random draws with one PRNG key per batch row, so a row's samples depend on its own key
only, never on its position in the batch or on the batch size (a seeded request gives the
same text alone and among others).

Every helper also takes a single key (shape ()), and then draws exactly as the
`jax.random` function it wraps: callers that pass one key for the whole batch (tests,
one-off use) get the same numbers as before.

Shape legend: B batch (the leading axis of per-row keys and of the arrays drawn for).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def per_row(rng: jax.Array) -> bool:
    """True for [B] keys, False for one key."""
    return rng.ndim > 0


def split(rng: jax.Array, num: int) -> jax.Array:
    """[num] keys from one key, or [num, B] from [B] keys (unpack along the first axis)."""
    if not per_row(rng):
        return jax.random.split(rng, num)
    return jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, num))(rng), 0, 1)


def fold_in(rng: jax.Array, data: jax.Array) -> jax.Array:
    """Row b's key folded with data[b] ([B] keys, [B] ints): a fresh key per row and step."""
    return jax.vmap(jax.random.fold_in)(rng, data.astype(jnp.uint32))


def uniform(rng: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """U[0, 1) float32 of `shape` = (B, ...); per-row keys draw row b from key b."""
    if not per_row(rng):
        return jax.random.uniform(rng, shape)
    return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(rng)


def categorical(rng: jax.Array, logits: jax.Array) -> jax.Array:
    """One draw over the last axis of logits [B, ..., V] -> [B, ...]."""
    if not per_row(rng):
        return jax.random.categorical(rng, logits, axis=-1)
    return jax.vmap(lambda k, x: jax.random.categorical(k, x, axis=-1))(rng, logits)


def row_keys(seeds: jax.Array) -> jax.Array:
    """[B] uint32 seeds -> [B] keys, key b = jax.random.key(seeds[b])."""
    return jax.vmap(jax.random.key)(seeds.astype(jnp.uint32))
