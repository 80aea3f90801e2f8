"""Checks shared by every implementation of `vocab_top_k` / `dspine_proposal`.

R rows (batch x slots), D hidden, V vocab, k kept values, KP = k rounded up to a power of
two (the width of a kernel's running top-k), BR/BV row/vocab tile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..vocab_tiles import check_hidden_weight

OP = "vocab_top_k"
IMPLEMENTATIONS = ("auto", "xla", "pallas_tpu", "pallas_gpu")


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def check_inputs(hidden, weight, k, implementation) -> None:
    """Raises ValueError at trace time (shapes and dtypes only)."""
    def fail(what):
        raise ValueError(f"{OP}: {what}")

    if implementation not in IMPLEMENTATIONS:
        fail(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    check_hidden_weight(OP, hidden, weight)
    if not isinstance(k, int) or not 1 <= k <= weight.shape[0]:
        fail(f"k must be an int in 1..V={weight.shape[0]}, got {k!r}")


def merge_top_k(run_v, run_i, tile_v, tile_i, kp: int):
    """The top-kp of two candidate sets, value descending, ties to the lower id.

    run_v/run_i [BR, kp], tile_v/tile_i [BR, BV] (or broadcastable ids); ids must be
    distinct across both sets. kp passes of max / min-id / knock-out, written with
    elementwise ops and row reductions only, so the same code lowers in Triton, Mosaic
    TPU and plain XLA."""
    big = jnp.iinfo(jnp.int32).max
    tile_i = jnp.broadcast_to(tile_i, tile_v.shape)
    lane = jax.lax.broadcasted_iota(jnp.int32, run_v.shape, 1)
    new_v = jnp.full(run_v.shape, -jnp.inf, jnp.float32)
    new_i = jnp.zeros(run_i.shape, jnp.int32)
    for j in range(kp):
        m = jnp.maximum(run_v.max(axis=1), tile_v.max(axis=1))                  # [BR]
        sel = jnp.minimum(jnp.where(run_v == m[:, None], run_i, big).min(axis=1),
                          jnp.where(tile_v == m[:, None], tile_i, big).min(axis=1))
        new_v = jnp.where(lane == j, m[:, None], new_v)
        new_i = jnp.where(lane == j, sel[:, None], new_i)
        run_v = jnp.where(run_i == sel[:, None], -jnp.inf, run_v)
        tile_v = jnp.where(tile_i == sel[:, None], -jnp.inf, tile_v)
    return new_v, new_i
