"""lm_head_stats' forward as a Mosaic TPU kernel (`jax.experimental.pallas.tpu`).

R rows, D hidden, V vocab, BR/BV row/vocab tiles.

The layout of `dspine_proposal/tpu.py`'s vocab_top_k: the grid is (ceil(R / BR),
ceil(V / BV)), the vocabulary axis "arbitrary" (sequential); step (i, j) receives rows i
of the hidden states and vocabulary tile j of the lm_head by the Pallas pipeline's
double-buffered DMA, computes the [BR, BV] float32 logits on the MXU and folds them into a
running max, sum of exp(logit - max) and count before the label, held in VMEM scratch
(lane-replicated [BR, 128], the TPU's tile); the last step writes them. Columns past V
are -inf. The [R, V] logits never leave VMEM.

Not yet run on a TPU: checked on the CPU in TPU interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128


def _kernel(h_ref, e_ref, value_ref, label_ref, max_out, sum_out, count_out, top, total,
            count, *, vocab, block_v, n_tiles, precision):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        top[...] = jnp.full(top.shape, -jnp.inf, jnp.float32)
        total[...] = jnp.zeros(total.shape, jnp.float32)
        count[...] = jnp.zeros(count.shape, jnp.int32)

    h = h_ref[...]                                                    # [BR, D]
    e = e_ref[...].astype(h.dtype)                                    # [BV, D]
    logits = lax.dot_general(h, e, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)      # [BR, BV]
    ids = j * block_v + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    logits = jnp.where(ids < vocab, logits, -jnp.inf)
    value = value_ref[:, :1]                                          # [BR, 1]
    label = label_ref[:, :1]
    old = top[:, :1]
    new = jnp.maximum(old, jnp.max(logits, axis=1, keepdims=True))    # finite: tile < V
    add = jnp.sum(jnp.exp(logits - new), axis=1, keepdims=True)
    before = (logits > value) | ((logits == value) & (ids < label))
    seen = jnp.sum(jnp.where(before & (ids != label), 1, 0), axis=1, keepdims=True)
    total[...] = jnp.broadcast_to(total[:, :1] * jnp.exp(old - new) + add, total.shape)
    top[...] = jnp.broadcast_to(new, top.shape)
    count[...] = count[...] + jnp.broadcast_to(seen, count.shape)

    @pl.when(j == n_tiles - 1)
    def _finish():
        max_out[...] = top[...]
        sum_out[...] = total[...]
        count_out[...] = count[...]


def forward_tpu(hidden, weight, labels, value, *, interpret=False, block_r=None,
                block_v=512):
    """Partials ([1, R] max, [1, R] sum, [1, R] count) for `common.combine`."""
    r, d = hidden.shape
    vocab = weight.shape[0]
    block_r = block_r or min(128, max(8, 1 << max(0, (r - 1).bit_length())))
    block_v = min(block_v, max(LANES, 1 << max(0, (vocab - 1).bit_length())))
    row_tiles = -(-r // block_r)
    n_tiles = -(-vocab // block_v)
    pad = row_tiles * block_r - r
    h = jnp.pad(hidden, ((0, pad), (0, 0)))
    lanes = lambda x: jnp.broadcast_to(jnp.pad(x, (0, pad))[:, None],  # noqa: E731
                                       (row_tiles * block_r, LANES))
    precision = lax.Precision.HIGHEST if hidden.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, vocab=vocab, block_v=block_v, n_tiles=n_tiles,
                               precision=precision)
    rows = pl.BlockSpec((block_r, LANES), lambda i, j: (i, 0))
    shape = (row_tiles * block_r, LANES)
    maxes, sums, counts = pl.pallas_call(
        kernel,
        grid=(row_tiles, n_tiles),
        in_specs=[pl.BlockSpec((block_r, d), lambda i, j: (i, 0)),
                  pl.BlockSpec((block_v, d), lambda i, j: (j, 0)), rows, rows],
        out_specs=[rows, rows, rows],
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32),
                   jax.ShapeDtypeStruct(shape, jnp.float32),
                   jax.ShapeDtypeStruct(shape, jnp.int32)],
        scratch_shapes=[pltpu.VMEM((block_r, LANES), jnp.float32),
                        pltpu.VMEM((block_r, LANES), jnp.float32),
                        pltpu.VMEM((block_r, LANES), jnp.int32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="lm_head_stats",
    )(h, weight, lanes(value), lanes(labels.astype(jnp.int32)))
    return maxes[None, :r, 0], sums[None, :r, 0], counts[None, :r, 0]
