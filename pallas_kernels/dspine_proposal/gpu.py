"""vocab_top_k for NVIDIA GPUs (Hopper), written with Pallas's Triton lowering.

R rows, D hidden, V vocab, k kept, KP = next power of two >= k, BR/BV/BD row/vocab/hidden
tiles, S vocab splits.

Layout of the work. The grid is (ceil(R / BR), S): program (i, s) owns BR rows and a
contiguous run of vocab tiles of BV rows of the lm_head. For each tile it computes the
[BR, BV] logits (float32 accumulation over D in BD-wide chunks, so D need only be a
multiple of 16, e.g. 576), merges them into a running top-KP held in registers
(`merge_top_k`: KP passes of max / min-id / knock-out), and skips the merge when no row
of the tile beats that row's current KP-th value (after the first tiles almost all
tiles). Each program writes its partial top-KP; an XLA top_k over the S * KP partials per
row gives the result. The [R, V] logits never exist outside the registers. Flash-decoding
style splitting is what keeps the lm_head read spread over the whole chip when R is
small (R = 15 at batch 1, K = 16): S is chosen so that ceil(R / BR) * S is about twice
the multiprocessor count. Vocab rows past V are clamped to row V - 1 and masked to -inf.

Why Triton and not Mosaic GPU: as for `ragged_paged_attention/gpu.py`, a Mosaic GPU
kernel compiles only on a GPU, while the Triton kernel lowers on the CPU
(jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))) and runs in Pallas's
interpret mode, so CI tests it. The Triton lowering is deprecated in JAX 0.11 but still
ships; a Mosaic GPU port keeps this grid, the merge and the XLA combine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..vocab_tiles import gpu_grid, gpu_tile_logits
from .common import merge_top_k, next_pow2


def _kernel(h_ref, e_ref, v_out, i_out, *, vocab, block_r, block_v, block_d, kp,
            tiles_per_split, n_tiles, precision):
    split = pl.program_id(1)
    r0 = pl.program_id(0) * block_r
    lo = split * tiles_per_split
    hi = jnp.minimum(n_tiles, lo + tiles_per_split)
    col = lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
    lane = lax.broadcasted_iota(jnp.int32, (block_r, kp), 1)

    def body(tile, carry):
        run_v, run_i = carry
        v0 = tile * block_v
        acc = gpu_tile_logits(h_ref, e_ref, r0, v0, vocab=vocab, block_r=block_r,
                              block_v=block_v, block_d=block_d, precision=precision)
        ids = v0 + col                                                # [1, BV]
        kth = run_v.min(axis=1)                                       # [BR]
        better = jnp.max(jnp.where(acc.max(axis=1) > kth, 1, 0))
        # out-of-range columns get ids past V that no real id can equal
        tile_ids = jnp.where(ids < vocab, ids, vocab + kp + col)
        return lax.cond(better > 0,
                        lambda: merge_top_k(run_v, run_i, acc, tile_ids, kp),
                        lambda: (run_v, run_i))

    init = (jnp.full((block_r, kp), -jnp.inf, jnp.float32), vocab + lane)
    run_v, run_i = lax.fori_loop(lo, hi, body, init)
    v_out[...] = run_v
    i_out[...] = run_i


def vocab_top_k_gpu(hidden, weight, k: int, *, interpret=False, block_r=None, block_v=None,
                    num_splits=None, num_warps=None, num_stages=None):
    r, d = hidden.shape
    vocab = weight.shape[0]
    grid = gpu_grid("vocab_top_k", r, d, vocab, block_r=block_r, block_v=block_v,
                    num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
    block_r, row_tiles, num_splits = grid.block_r, grid.row_tiles, grid.num_splits
    kp = max(16, next_pow2(k))
    h = jnp.pad(hidden, ((0, row_tiles * block_r - r), (0, 0)))
    precision = lax.Precision.HIGHEST if hidden.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, vocab=vocab, block_r=block_r, block_v=grid.block_v,
                               block_d=grid.block_d, kp=kp,
                               tiles_per_split=grid.tiles_per_split, n_tiles=grid.n_tiles,
                               precision=precision)
    whole = pl.no_block_spec
    out_spec = pl.BlockSpec((None, block_r, kp), lambda i, s: (s, i, 0))
    vals, ids = pl.pallas_call(
        kernel,
        grid=(row_tiles, num_splits),
        in_specs=[whole, whole],
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((num_splits, row_tiles * block_r, kp), jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, row_tiles * block_r, kp), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=grid.num_warps,
                                                num_stages=grid.num_stages),
        interpret=interpret,
        name="vocab_top_k",
    )(h, weight)
    return combine_top_k(vals[:, :r], ids[:, :r], k)


def combine_top_k(vals, ids, k):
    """Partials [S, R, KP] -> top-k [R, k], value descending, ties to the lower id."""
    s, r, kp = vals.shape
    vals = jnp.moveaxis(vals, 0, 1).reshape(r, s * kp)
    ids = jnp.moveaxis(ids, 0, 1).reshape(r, s * kp)
    # Sort partials by id first so lax.top_k's lower-index-first tie rule is the id rule.
    order = jnp.argsort(ids, axis=1)
    vals = jnp.take_along_axis(vals, order, 1)
    ids = jnp.take_along_axis(ids, order, 1)
    top, where = lax.top_k(vals, k)
    return top, jnp.take_along_axis(ids, where, 1)
