"""lm_head_stats' forward for NVIDIA GPUs (Hopper), written with Pallas's Triton lowering.

R rows, D hidden, V vocab, BR/BV/BD row/vocab/hidden tiles, S vocabulary splits.

The layout of `dspine_proposal/gpu.py`'s vocab_top_k: the grid is (ceil(R / BR), S) and
program (i, s) owns BR rows and a contiguous run of vocabulary tiles of BV lm_head rows.
For each tile it computes the [BR, BV] logits (float32 accumulation over D in BD-wide
chunks) and folds them into a running max, sum of exp(logit - max) and count of entries
before the row's label (greater, or equal at a lower id), all in registers. Each program
writes its three partials per row; `common.combine` merges the S splits. The [R, V]
logits never leave the chip. With top_k, each program also keeps `vocab_top_k`'s running
top-k of the same tiles (its merge, skipped where no row's tile beats its k-th): the
stats and the top-k candidates in one pass over the lm_head, not two. Splitting over the
vocabulary keeps the whole GPU busy when R is small; at training's R (16,384 slots) S is
1-2 and the row tiles fill it.

Compiled and timed only where a CUDA GPU is present (tests marked `gpu`); elsewhere the
tests run it in Pallas interpret mode. The Triton lowering is deprecated in JAX 0.11 but
still ships (see ragged_paged_attention/gpu.py for why these kernels use it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..dspine_proposal.common import merge_top_k, next_pow2
from ..dspine_proposal.gpu import combine_top_k
from ..vocab_tiles import gpu_grid, gpu_tile_logits


def _kernel(h_ref, e_ref, value_ref, label_ref, max_out, sum_out, count_out, *top_out,
            vocab, block_r, block_v, block_d, tiles_per_split, n_tiles, precision, kp):
    """kp > 0: also a running top-kp of the tile logits per row (`vocab_top_k`'s merge),
    written to top_out = (values, ids)."""
    split = pl.program_id(1)
    r0 = pl.program_id(0) * block_r
    lo = split * tiles_per_split
    hi = jnp.minimum(n_tiles, lo + tiles_per_split)
    col = lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
    value = value_ref[pl.ds(r0, block_r)][:, None]                    # [BR, 1]
    label = label_ref[pl.ds(r0, block_r)][:, None]

    def body(tile, carry):
        top, total, count, *run = carry
        v0 = tile * block_v
        logits = gpu_tile_logits(h_ref, e_ref, r0, v0, vocab=vocab, block_r=block_r,
                                 block_v=block_v, block_d=block_d, precision=precision)
        ids = v0 + col                                                # [1, BV]
        new_top = jnp.maximum(top, logits.max(axis=1))                # finite: tile < V
        total = total * jnp.exp(top - new_top) + jnp.exp(logits - new_top[:, None]).sum(1)
        before = (logits > value) | ((logits == value) & (ids < label))
        count = count + jnp.where(before & (ids != label), 1, 0).sum(axis=1)
        if kp:
            run_v, run_i = run
            # merge only where some row's best beats its kp-th (after the first tiles
            # almost never); out-of-range columns get ids past V no real id equals
            better = jnp.max(jnp.where(logits.max(axis=1) > run_v.min(axis=1), 1, 0))
            tile_ids = jnp.where(ids < vocab, ids, vocab + kp + col)
            run = lax.cond(better > 0,
                           lambda: merge_top_k(run_v, run_i, logits, tile_ids, kp),
                           lambda: (run_v, run_i))
        return (new_top, total, count, *run)

    init = (jnp.full((block_r,), -jnp.inf, jnp.float32), jnp.zeros((block_r,), jnp.float32),
            jnp.zeros((block_r,), jnp.int32))
    if kp:
        lane = lax.broadcasted_iota(jnp.int32, (block_r, kp), 1)
        init += (jnp.full((block_r, kp), -jnp.inf, jnp.float32), vocab + lane)
    top, total, count, *run = lax.fori_loop(lo, hi, body, init)
    max_out[...] = top
    sum_out[...] = total
    count_out[...] = count
    for out, x in zip(top_out, run):
        out[...] = x


def forward_gpu(hidden, weight, labels, value, *, top_k=0, interpret=False, block_r=None,
                block_v=None, num_splits=None, num_warps=None, num_stages=None):
    """Partials ([S, R] max, [S, R] sum, [S, R] count) for `common.combine`; with
    top_k > 0 also the top-k ids [R, top_k] of the same logits (`vocab_top_k`'s)."""
    r, d = hidden.shape
    vocab = weight.shape[0]
    grid = gpu_grid("lm_head_stats", r, d, vocab, block_r=block_r, block_v=block_v,
                    num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
    block_r, row_tiles, num_splits = grid.block_r, grid.row_tiles, grid.num_splits
    kp = max(16, next_pow2(top_k)) if top_k else 0
    pad = row_tiles * block_r - r
    h = jnp.pad(hidden, ((0, pad), (0, 0)))
    value = jnp.pad(value, (0, pad))
    labels = jnp.pad(labels.astype(jnp.int32), (0, pad))
    precision = lax.Precision.HIGHEST if hidden.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, vocab=vocab, block_r=block_r, block_v=grid.block_v,
                               block_d=grid.block_d, tiles_per_split=grid.tiles_per_split,
                               n_tiles=grid.n_tiles, precision=precision, kp=kp)
    whole = pl.no_block_spec
    out_spec = pl.BlockSpec((None, block_r), lambda i, s: (s, i))
    shape = (num_splits, row_tiles * block_r)
    out_specs = [out_spec] * 3
    out_shape = [jax.ShapeDtypeStruct(shape, jnp.float32),
                 jax.ShapeDtypeStruct(shape, jnp.float32),
                 jax.ShapeDtypeStruct(shape, jnp.int32)]
    if kp:
        out_specs += [pl.BlockSpec((None, block_r, kp), lambda i, s: (s, i, 0))] * 2
        out_shape += [jax.ShapeDtypeStruct(shape + (kp,), jnp.float32),
                      jax.ShapeDtypeStruct(shape + (kp,), jnp.int32)]
    maxes, sums, counts, *top = pl.pallas_call(
        kernel,
        grid=(row_tiles, num_splits),
        in_specs=[whole, whole, whole, whole],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=grid.num_warps,
                                                num_stages=grid.num_stages),
        interpret=interpret,
        name="lm_head_stats_top_k" if kp else "lm_head_stats",
    )(h, weight, value, labels)
    partials = maxes[:, :r], sums[:, :r], counts[:, :r]
    if not kp:
        return partials
    return partials, combine_top_k(top[0][:, :r], top[1][:, :r], top_k)[1]
