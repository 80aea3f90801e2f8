"""The threshold search's rounds for NVIDIA GPUs, written with Pallas's Triton lowering.

R rows, V vocab, W candidates per round, S vocabulary splits, BV vocabulary tile.

`search.search_threshold` runs 2 x rounds(W) rounds, each one reduction over the
vocabulary against W candidates per row. In XLA that reduction reads the row once per
candidate. Here one launch per round does it: program (r, s) streams its share of row r
in BV-wide tiles and compares each tile against the W candidates at once, accumulating a
[W, BV] count or mass in registers and reducing it across lanes once at the end, so the
row is read once per round and no [R, W, V] intermediate exists. The S splits keep the
GPU busy when R is small (a batch-1 verify has 16 rows); XLA sums the [R, S, W] partials
and narrows the interval. Rows whose search is not needed (no top-k, or a kept set down
to t_k) return zeros without reading.

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

from ..platform import multiprocessors
from .search import WAYS, ordered_key, search_threshold

# A program's [W, BV] accumulator holds ACCUMULATOR entries (64 registers a thread at 8
# warps): BV = ACCUMULATOR // W.
ACCUMULATOR = 16 * 1024
NUM_WARPS = 8
NUM_STAGES = 2
PROGRAMS_PER_MULTIPROCESSOR = 2


def _round_kernel(x_ref, cand_ref, top_ref, active_ref, out_ref, *, kind, vocab, block_v,
                  tiles_per_split, n_tiles):
    r, s = pl.program_id(0), pl.program_id(1)
    first = s * tiles_per_split
    last = jnp.minimum(n_tiles, first + tiles_per_split)
    lanes = lax.broadcasted_iota(jnp.int32, (block_v,), 0)
    cand = cand_ref[r, :][:, None]                                     # [W, 1]
    ways = cand.shape[0]
    top = top_ref[r]

    def tile(t, acc):
        cols = t * block_v + lanes
        x = x_ref[r, jnp.minimum(cols, vocab - 1)]                     # [BV], clamped reads
        valid = (cols < vocab)[None, :]
        key = ordered_key(x)[None, :]
        if kind == "count_ge":
            return acc + jnp.where((key >= cand) & valid, 1, 0)
        e = jnp.where(valid, jnp.exp(x - top)[None, :], 0.0)
        return acc + jnp.where(key > cand, e, 0.0)

    dtype = jnp.int32 if kind == "count_ge" else jnp.float32

    def reduce():
        acc = lax.fori_loop(first, last, tile, jnp.zeros((ways, block_v), dtype))
        return jnp.sum(acc, axis=1)

    out_ref[...] = lax.cond(active_ref[r] > 0, reduce, lambda: jnp.zeros((ways,), dtype))


def _num_splits(rows: int, n_tiles: int) -> int:
    """Vocabulary splits per row: enough programs for every multiprocessor."""
    want = -(-PROGRAMS_PER_MULTIPROCESSOR * multiprocessors() // rows)
    return max(1, min(n_tiles, want))


def _tiling(rows: int, vocab: int, ways: int):
    """(block_v, tiles_per_split, num_splits, n_tiles) of a round over [rows, vocab]
    against `ways` candidates a row."""
    block_v = ACCUMULATOR // ways
    n_tiles = pl.cdiv(vocab, block_v)
    tiles_per_split = pl.cdiv(n_tiles, _num_splits(rows, n_tiles))
    return block_v, tiles_per_split, pl.cdiv(n_tiles, tiles_per_split), n_tiles


def gpu_round_stat(keys, scaled, top, *, interpret=False):
    """`search_threshold`'s round reduction as one Pallas launch per round; the tiles
    follow the candidates' count (W = cand's last axis)."""
    del keys                                   # each tile's keys are recomputed in registers
    rows, vocab = scaled.shape

    def stat(kind, cand, active):
        ways = cand.shape[-1]
        block_v, tiles_per_split, num_splits, n_tiles = _tiling(rows, vocab, ways)
        dtype = jnp.int32 if kind == "count_ge" else jnp.float32
        kernel = functools.partial(_round_kernel, kind=kind, vocab=vocab, block_v=block_v,
                                   tiles_per_split=tiles_per_split, n_tiles=n_tiles)
        partials = pl.pallas_call(
            kernel,
            grid=(rows, num_splits),
            in_specs=[pl.no_block_spec] * 4,
            out_specs=pl.BlockSpec((None, None, ways), lambda r, s: (r, s, 0)),
            out_shape=jax.ShapeDtypeStruct((rows, num_splits, ways), dtype),
            compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS,
                                                    num_stages=NUM_STAGES),
            interpret=interpret,
            name=f"warp_threshold_{kind}",
        )(scaled, cand, top, active.astype(jnp.int32))
        return jnp.sum(partials, axis=1)                                # [R, W]
    return stat


@functools.partial(jax.jit, static_argnames=("ways", "interpret"))
def warp_threshold_gpu(scaled, k, top_p, *, ways=WAYS, interpret=False):
    """scaled [R, V] float32, k [R] int32, top_p [R] float32 -> tau [R] float32."""
    return search_threshold(scaled, k, top_p, ways=ways, round_stat=functools.partial(
        gpu_round_stat, interpret=interpret))
