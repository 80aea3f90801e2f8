"""lax.top_k over long rows (a vocabulary), exact, in two stages on a GPU.

XLA's GPU TopK runs one row per thread block, so a few long rows leave the GPU idle:
15 rows of 49,152 logits took 168 us in a SmolLM2 DSpine pass (10% of it), and the
training loss's 16,384 rows 16 ms of a 141 ms step. Split into chunks, every row becomes
many short rows: the top-k of each chunk, then the top-k of those n_chunks * k
survivors. The result is lax.top_k's exactly: a token in the global top-k is in its own
chunk's top-k, and the survivors stay in index order (chunk by chunk, each chunk's ties
lower index first), so ties still go to the lower index. On a CPU one pass over the row
is faster (3x at these shapes), so the split is made on GPUs only.
DSPINE_TOP_K_SPLIT=0 in the environment turns the split off (before/after timings).

Shape legend: R rows, V row length, C chunk, n = ceil(V / C) chunks.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

CHUNK = 1024


def _lowest(dtype):
    dtype = jnp.dtype(dtype)
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def two_stage_top_k(x: jax.Array, k: int, chunk: int = CHUNK):
    """x [R, V], static k <= chunk -> (values [R, k], indices [R, k] int32), as
    lax.top_k(x, k); the last chunk is padded with the dtype's lowest value, which never
    wins a tie against a real entry (padding comes after every real index)."""
    r, v = x.shape
    if not 1 <= k <= chunk:
        raise ValueError(f"two_stage_top_k needs 1 <= k <= chunk ({chunk}), got k={k}")
    n = -(-v // chunk)
    padded = jnp.pad(x, ((0, 0), (0, n * chunk - v)), constant_values=_lowest(x.dtype))
    values, ids = jax.lax.top_k(padded.reshape(r * n, chunk), k)        # [R * n, k]
    ids = ids.reshape(r, n, k) + (jnp.arange(n, dtype=ids.dtype) * chunk)[None, :, None]
    top, where = jax.lax.top_k(values.reshape(r, n * k), k)              # [R, k]
    return top, jnp.take_along_axis(ids.reshape(r, n * k), where, -1).astype(jnp.int32)


def splits_rows() -> bool:
    """Whether `top_k` splits long rows: on GPUs, unless DSPINE_TOP_K_SPLIT=0."""
    return jax.default_backend() == "gpu" and os.environ.get("DSPINE_TOP_K_SPLIT") != "0"


def top_k(x: jax.Array, k: int):
    """lax.top_k over the last axis of x [..., V] -> (values [..., k], indices [..., k]
    int32): two stages on a GPU when rows are long (V >= 4 chunks and k <= chunk / 4),
    one otherwise. Leading axes are flattened first: XLA's CPU backend keeps its TopK
    kernel only for rank-2 operands (a higher rank becomes a full sort of the row)."""
    lead, v = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, v)
    if splits_rows() and v >= 4 * CHUNK and k <= CHUNK // 4:
        values, ids = two_stage_top_k(flat, k)
    else:
        values, ids = jax.lax.top_k(flat, k)
    return values.reshape(lead + (k,)), ids.reshape(lead + (k,)).astype(jnp.int32)
