"""x @ W^T for a few rows against wide weights, the input width split over programs, for
NVIDIA GPUs (Pallas's Triton lowering).

M rows, K input width, N output width, BM/BN/BK row/column/input tiles, S input splits.

A verify at batch B runs M = B x 16 rows through every projection: at M <= 256 the
product reads far more weight bytes than it computes, so it should run at the weights'
read. A grid over output tiles alone has N / BN programs, fewer than a GPU's
multiprocessors for a 4,096-wide output (32 tiles of 128), and each program then streams
its whole [BN, K] slice alone. Here program (j, s) owns output tile j and the s-th of S
equal slices of the input width, walks it in BK-wide chunks (Triton pipelines the chunk
loads, `num_stages` in flight) and writes a float32 [BM, BN] partial; XLA sums the S
partials and casts (one small fusion; S = 1 writes the output directly). The rows are one
tile (padded to BM, a power of two >= 16 that Triton's dot needs; wgmma from 64).

Compiled and timed only where a CUDA GPU is present; elsewhere the tests run it in
Pallas interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .platform import multiprocessors

MIN_ROWS = 16      # below: an AR step's few rows, XLA's matrix-vector fusions
MAX_ROWS = 256


@dataclasses.dataclass(frozen=True)
class Tiling:
    block_n: int = 128
    block_k: int = 64
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 4


def default_tiling(m: int, n: int, k: int, sm_count: int | None = None) -> Tiling:
    """BN 128 (64 at 256 rows, for the accumulator's registers), BK 64, and the most splits
    (a power of two, at most 8) that keep the programs within two per multiprocessor and
    each program at least 16 chunks long."""
    sm_count = sm_count or multiprocessors()
    block_n = 64 if m > 128 else 128
    block_k = 64
    tiles, chunks = n // block_n, k // block_k
    splits = 1
    while (splits < 8 and tiles * splits * 2 <= 2 * sm_count
           and chunks % (splits * 2) == 0 and chunks // (splits * 2) >= 16):
        splits *= 2
    return Tiling(block_n=block_n, block_k=block_k, splits=splits)


def check_shapes(m: int, n: int, k: int, tiling: Tiling) -> None:
    for name, size in (("block_n", tiling.block_n), ("block_k", tiling.block_k)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"split_k_matmul: {name} must be a power of two >= 16, got {size}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"split_k_matmul: 1 to {MAX_ROWS} rows, got {m}")
    if n % tiling.block_n:
        raise ValueError(f"split_k_matmul: N = {n} is not a multiple of block_n "
                         f"{tiling.block_n}")
    if tiling.splits < 1 or k % (tiling.block_k * tiling.splits):
        raise ValueError(f"split_k_matmul: K = {k} does not split into {tiling.splits} "
                         f"slices of whole {tiling.block_k}-wide chunks")


def fits(m: int, n: int, k: int, tiling: Tiling | None = None) -> bool:
    """Whether `tiling` (default_tiling(m, n, k) when None) can run an [m, k] x [n, k]^T
    product."""
    try:
        check_shapes(m, n, k, tiling or default_tiling(m, n, k))
    except ValueError:
        return False
    return True


def _kernel(x_ref, w_ref, out_ref, *, block_m, block_n, block_k, steps):
    j, s = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(j * block_n, block_n)
    first = s * steps

    def chunk(i, acc):
        k0 = pl.multiple_of((first + i) * block_k, block_k)
        xs = x_ref[pl.ds(0, block_m), pl.ds(k0, block_k)]             # [BM, BK]
        ws = w_ref[pl.ds(n0, block_n), pl.ds(k0, block_k)]            # [BN, BK]
        return acc + pltriton.dot(xs, ws, trans_b=True)

    acc = lax.fori_loop(0, steps, chunk, jnp.zeros((block_m, block_n), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def split_k_matmul(x: jax.Array, w: jax.Array, tiling: Tiling | None = None,
                   interpret: bool = False) -> jax.Array:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype, float32 accumulation.
    tiling: default_tiling(M, N, K) when None."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"split_k_matmul: x is [M, {k}] but w is {w.shape}")
    tiling = tiling or default_tiling(m, n, k)
    check_shapes(m, n, k, tiling)
    block_m = max(16, 1 << (m - 1).bit_length())
    if block_m != m:
        x = jnp.pad(x, ((0, block_m - m), (0, 0)))
    splits = tiling.splits
    out_dtype = x.dtype if splits == 1 else jnp.float32
    kernel = functools.partial(_kernel, block_m=block_m, block_n=tiling.block_n,
                               block_k=tiling.block_k,
                               steps=k // (tiling.block_k * splits))
    partials = pl.pallas_call(
        kernel,
        grid=(n // tiling.block_n, splits),
        in_specs=[pl.no_block_spec, pl.no_block_spec],
        out_specs=pl.BlockSpec((None, block_m, tiling.block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, block_m, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tiling.num_warps,
                                                num_stages=tiling.num_stages),
        interpret=interpret,
        name="split_k_matmul",
    )(x, w.astype(x.dtype))
    out = partials[0] if splits == 1 else jnp.sum(partials, axis=0).astype(x.dtype)
    return out[:m]
