"""The threshold search for NVIDIA GPUs, written with Pallas's Triton lowering.

R rows, V vocab, W = WAYS candidates, BV vocabulary tile.

One program per row streams its V logits from memory in BV-wide tiles, once per pass:
one for the row's max and extreme keys, ROUNDS for each search (the t_k search only
where the row has a top-k), one for the top-k set's mass. A pass compares every tile
against the W candidates at once ([W, BV] in registers) and keeps [W] running counts or
sums, so a search round reads the row once and no [R, V] intermediate is written. The
searches loop on the device: nothing waits on the host and no row is sorted.

Compiled and timed only where a CUDA GPU is present (tests marked `gpu`); elsewhere the
tests run it in Pallas interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .search import ROUNDS, WAYS, candidates, key_value, narrow, ordered_key

BLOCK_V = 1024
NUM_WARPS = 8


def _kernel(x_ref, k_ref, p_ref, tau_ref, *, vocab, block_v):
    r = pl.program_id(0)
    n_tiles = pl.cdiv(vocab, block_v)
    lanes = lax.broadcasted_iota(jnp.int32, (block_v,), 0)
    k = k_ref[r]
    top_p = p_ref[r]

    def tile(t):
        """[BV] logits and keys of tile t, and which lanes lie inside the row."""
        cols = t * block_v + lanes
        x = x_ref[r, jnp.minimum(cols, vocab - 1)]                     # clamped reads
        return x, ordered_key(x), cols < vocab

    def extremes(t, carry):
        top, lo, hi = carry
        x, key, valid = tile(t)
        return (jnp.maximum(top, jnp.max(jnp.where(valid, x, -jnp.inf))),
                jnp.minimum(lo, jnp.min(jnp.where(valid, key, jnp.iinfo(jnp.int32).max))),
                jnp.maximum(hi, jnp.max(jnp.where(valid, key, jnp.iinfo(jnp.int32).min))))

    top, lo, hi = lax.fori_loop(0, n_tiles, extremes,
                                (jnp.float32(-jnp.inf), jnp.int32(jnp.iinfo(jnp.int32).max),
                                 jnp.int32(jnp.iinfo(jnp.int32).min)))

    def largest_where(reduce_tile, init, test, lo, hi):
        """The largest key in [lo, hi] where test(reduction) holds, the reduction summed
        over tiles from reduce_tile(cand [W, 1], tile) -> [W]."""
        def one_round(_, bounds):
            lo, hi = bounds
            cand = candidates(lo, hi)                                  # [W]
            total = lax.fori_loop(
                0, n_tiles, lambda t, acc: acc + reduce_tile(cand[:, None], t),
                jnp.full((WAYS,), init))
            return narrow(cand, test(total), hi)
        return lax.fori_loop(0, ROUNDS, one_round, (lo, hi))[0]

    def count_at_or_above(cand, t):
        _, key, valid = tile(t)
        return jnp.sum(jnp.where((key[None, :] >= cand) & valid[None, :], 1, 0), axis=1)

    t_k = lax.cond(k < vocab,
                   lambda: largest_where(count_at_or_above, 0, lambda n: n >= k, lo, hi),
                   lambda: lo)

    def above_t_k(t, carry):
        mass, count = carry
        x, key, valid = tile(t)
        above = (key > t_k) & valid
        return (mass + jnp.sum(jnp.where(above, jnp.exp(x - top), 0.0)),
                count + jnp.sum(jnp.where(above, 1, 0)))

    mass, count = lax.fori_loop(0, n_tiles, above_t_k, (jnp.float32(0), jnp.int32(0)))
    z = mass + (k - count).astype(jnp.float32) * jnp.exp(key_value(t_k) - top)

    def mass_above(cand, t):
        x, key, valid = tile(t)
        e = jnp.where(valid, jnp.exp(x - top), 0.0)[None, :]          # [1, BV]
        return jnp.sum(jnp.where(key[None, :] > cand, e, 0.0), axis=1)

    nucleus = (top_p < 1) & (mass >= top_p * z)
    kept_from = lax.cond(
        nucleus,
        lambda: largest_where(mass_above, 0.0, lambda m: m >= top_p * z, t_k, hi) + 1,
        lambda: t_k)
    tau_ref[r] = key_value(kept_from)


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "num_warps"))
def warp_threshold_gpu(scaled, k, top_p, *, interpret=False, block_v=BLOCK_V,
                       num_warps=NUM_WARPS):
    """scaled [R, V] float32, k [R] int32, top_p [R] float32 -> tau [R] float32."""
    r, vocab = scaled.shape
    kernel = functools.partial(_kernel, vocab=vocab, block_v=block_v)
    return pl.pallas_call(
        kernel,
        grid=(r,),
        in_specs=[pl.no_block_spec] * 3,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((r,), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="warp_threshold",
    )(scaled, k, top_p)
