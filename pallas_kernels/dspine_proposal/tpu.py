"""vocab_top_k as a Mosaic TPU kernel (`jax.experimental.pallas.tpu`).

R rows, D hidden, V vocab, k kept, KP = next power of two >= k, BR/BV row/vocab tiles.

The grid is (ceil(R / BR), ceil(V / BV)), the vocab axis "arbitrary" (sequential): step
(i, j) receives rows i of the hidden states and vocab tile j of the lm_head by the Pallas
pipeline's double-buffered DMA, computes the [BR, BV] float32 logits on the MXU, and
merges them into a running top-KP kept in VMEM scratch (`merge_top_k`), skipping the
merge when no row beats its current KP-th value; the last step writes the top-KP.
Columns past V (the padding of the last tile) are masked to -inf. The [R, V] logits never
leave VMEM.

Not yet run on a TPU: checked on the CPU in TPU interpret mode, and
lowered to Mosaic for the TPU platform on the CPU (jax.jit(...).trace(...).lower(
lowering_platforms=("tpu",))) at SmolLM2's shapes; Mosaic's own compile is untested.
Tuning left open: BV (512 by default), and splitting the vocab axis over the two
TensorCores of a v4/v5p chip (a second grid axis and an XLA combine, as gpu.py does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .common import merge_top_k, next_pow2

LANES = 128

def _kernel(h_ref, e_ref, v_out, i_out, run_v, run_i, *, vocab, block_v, kp, n_tiles,
            precision):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        run_v[...] = jnp.full(run_v.shape, -jnp.inf, jnp.float32)
        run_i[...] = vocab + lax.broadcasted_iota(jnp.int32, run_i.shape, 1)

    h = h_ref[...]                                                    # [BR, D]
    e = e_ref[...].astype(h.dtype)                                    # [BV, D]
    logits = lax.dot_general(h, e, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)      # [BR, BV]
    col = lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    ids = j * block_v + col
    logits = jnp.where(ids < vocab, logits, -jnp.inf)
    ids = jnp.where(ids < vocab, ids, vocab + run_i.shape[1] + col)
    cur_v = run_v[...]
    kth = cur_v[:, kp - 1:kp]                                         # [BR, 1]

    @pl.when(jnp.any(logits > kth))
    def _merge():
        new_v, new_i = merge_top_k(cur_v, run_i[...], logits, ids, run_v.shape[1])
        run_v[...] = new_v
        run_i[...] = new_i

    @pl.when(j == n_tiles - 1)
    def _finish():
        v_out[...] = run_v[...]
        i_out[...] = run_i[...]


def vocab_top_k_tpu(hidden, weight, k: int, *, interpret=False, block_r=None, block_v=512):
    r, d = hidden.shape
    vocab = weight.shape[0]
    kp = next_pow2(k)
    width = kp
    block_r = block_r or min(128, max(8, next_pow2(r)))
    block_v = min(block_v, max(LANES, next_pow2(vocab)))
    row_tiles = -(-r // block_r)
    n_tiles = -(-vocab // block_v)
    h = jnp.pad(hidden, ((0, row_tiles * block_r - r), (0, 0)))
    precision = lax.Precision.HIGHEST if hidden.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, vocab=vocab, block_v=block_v, kp=kp,
                               n_tiles=n_tiles, precision=precision)
    out_spec = pl.BlockSpec((block_r, kp), lambda i, j: (i, 0))
    vals, ids = pl.pallas_call(
        kernel,
        grid=(row_tiles, n_tiles),
        in_specs=[pl.BlockSpec((block_r, d), lambda i, j: (i, 0)),
                  pl.BlockSpec((block_v, d), lambda i, j: (j, 0))],
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((row_tiles * block_r, kp), jnp.float32),
                   jax.ShapeDtypeStruct((row_tiles * block_r, kp), jnp.int32)],
        scratch_shapes=[pltpu.VMEM((block_r, width), jnp.float32),
                        pltpu.VMEM((block_r, width), jnp.int32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="vocab_top_k",
    )(h, weight)
    return vals[:r, :k], ids[:r, :k]
