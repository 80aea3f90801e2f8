"""What the ops over an lm_head's vocabulary share (`dspine_proposal.vocab_top_k`,
`lm_head_stats`): the checks of hidden [R, D] against weight [V, D], and the GPU kernels'
grid and one tile of logits.

R rows, D hidden, V vocab, BR/BV/BD row/vocab/hidden tiles.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .platform import multiprocessors

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def check_hidden_weight(op: str, hidden, weight) -> None:
    """Raises ValueError naming `op` unless hidden is [R, D] and weight [V, D], bf16/f32."""
    if hidden.ndim != 2 or weight.ndim != 2:
        raise ValueError(f"{op}: hidden must be [R, D] and weight [V, D], got {hidden.shape} "
                         f"and {weight.shape}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{op}: hidden width {hidden.shape[1]} differs from weight width "
                         f"{weight.shape[1]}")
    for name, x in (("hidden", hidden), ("weight", weight)):
        if jnp.dtype(x.dtype) not in DTYPES:
            raise ValueError(f"{op}: {name} dtype must be bfloat16 or float32, got {x.dtype}")


def gpu_tile_logits(h_ref, e_ref, r0, v0, *, vocab: int, block_r: int, block_v: int,
                    block_d: int, precision):
    """Inside a Triton-lowered kernel: the [BR, BV] float32 logits of hidden rows
    r0 .. r0 + BR against lm_head rows v0 .. v0 + BV, accumulated over D in BD-wide
    chunks (so D need only be a multiple of 16), -inf past V (those rows are read clamped
    to V - 1)."""
    rows = jnp.minimum(v0 + jnp.arange(block_v, dtype=jnp.int32), vocab - 1)

    # A loop, not a Python unroll: Triton gives every unrolled dot its own shared memory,
    # which at D = 4096 (64 chunks) asks for 2.6 MB of the SM's 228 KB.
    def chunk(j, acc):
        d0 = pl.multiple_of(j * block_d, block_d)
        h = h_ref[pl.ds(r0, block_r), pl.ds(d0, block_d)]             # [BR, BD]
        e = e_ref[rows, pl.ds(d0, block_d)]                           # [BV, BD]
        return acc + pltriton.dot(h, e.astype(h.dtype), trans_b=True, precision=precision)

    logits = lax.fori_loop(0, h_ref.shape[1] // block_d, chunk,
                           jnp.zeros((block_r, block_v), jnp.float32))
    ids = v0 + lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
    return jnp.where(ids < vocab, logits, -jnp.inf)


class GpuGrid(NamedTuple):
    """A GPU kernel's grid over (row tiles, vocabulary splits) and its tiles."""
    block_r: int
    block_v: int
    block_d: int
    row_tiles: int
    n_tiles: int           # vocabulary tiles of BV rows
    num_splits: int        # every split runs at least one tile
    tiles_per_split: int
    num_warps: int
    num_stages: int


def gpu_grid(op: str, r: int, d: int, vocab: int, *, block_r=None, block_v=None,
             num_splits=None, num_warps=None, num_stages=None) -> GpuGrid:
    """The grid of a GPU kernel over R rows of width D against a V-row lm_head (any
    argument given overrides its default): S splits such that the grid is about twice
    the multiprocessor count, so that a few rows still spread the lm_head's read over the
    whole chip. Raises ValueError naming `op` unless D is a multiple of 16."""
    if d % 16:
        raise ValueError(f"{op}: implementation='pallas_gpu' needs D % 16 == 0, got {d}")
    block_r = block_r or min(64, max(16, 1 << max(0, (r - 1).bit_length())))
    block_v = block_v or 128
    block_d = next(b for b in (64, 32, 16) if d % b == 0)
    n_tiles = -(-vocab // block_v)
    row_tiles = -(-r // block_r)
    if num_splits is None:
        num_splits = max(1, -(-2 * multiprocessors() // row_tiles))
    tiles_per_split = -(-n_tiles // min(num_splits, n_tiles))
    return GpuGrid(block_r, block_v, block_d, row_tiles, n_tiles,
                   -(-n_tiles // tiles_per_split), tiles_per_split, num_warps or 4,
                   num_stages or 2)
