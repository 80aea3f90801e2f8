"""Exact lax.top_k over long rows (a vocabulary), shaped for a GPU's TopK.

`top_k(x, k)` returns what lax.top_k(x, k) returns, ties to the lower index. XLA's GPU
TopK runs one thread block per row, so a few long rows leave the GPU idle and many short
rows pay a fixed cost each. On a GPU, therefore:
  * k >= 2: `grouped_top_k` cuts each row into groups of G, one reduction takes every
    group's maximum, a TopK over the maxima picks the k groups that can hold the row's
    top-k, and a TopK over their k * G entries finishes;
  * k = 1, or rows too short to group: when the rows are too few to fill the GPU,
    `two_stage_top_k` splits each into as many chunks as fill one wave (each at least
    MIN_CHUNK long), takes each chunk's top-k, then the top-k of the survivors.
Elsewhere (CPU, TPU) one lax.top_k. Both paths are exact: an entry of the row's top-k is
in the top-k of its own group or chunk, and survivors keep index order. The switches
`top_k_grouped` and `top_k_split` (`pallas_kernels.switches`; DSPINE_TOP_K_GROUPED=0 and
DSPINE_TOP_K_SPLIT=0) turn the two paths off (the grouped path against the split in a
decoding pass: docs/benchmarks.md, "Engine options").

Shape legend: R rows, V row length, C chunk, n = ceil(V / C) chunks; G group, n = ceil(V / G)
groups.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import switches

MIN_CHUNK = 1024
DEFAULT_MULTIPROCESSORS = 132  # H100/H200 SXM, where the device does not say


def _lowest(dtype):
    dtype = jnp.dtype(dtype)
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def two_stage_top_k(x: jax.Array, k: int, chunk: int):
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


def grouped_top_k(x: jax.Array, k: int, group: int):
    """x [R, V], static k <= ceil(V / group) -> (values [R, k], indices [R, k] int32), as
    lax.top_k(x, k). Exact, ties included: a group whose maximum ranks below the k-th
    group's cannot hold a top-k entry (each group ranked above it holds an entry ranked
    above all of its own), and groups are contiguous, so ranking maxima by (value, lower
    group first) ranks them as lax.top_k ranks entries. The chosen groups are put back in
    index order before the last TopK, so its ties still go to the lower index."""
    r, v = x.shape
    n = -(-v // group)
    if not 1 <= k <= n:
        raise ValueError(f"grouped_top_k needs 1 <= k <= ceil(V / group) ({n}), got k={k}")
    padded = jnp.pad(x, ((0, 0), (0, n * group - v)), constant_values=_lowest(x.dtype))
    groups = padded.reshape(r, n, group)                                 # [R, n, G]
    _, chosen = jax.lax.top_k(groups.max(-1), k)                         # [R, k]
    chosen = jnp.sort(chosen, axis=-1)
    members = jnp.take_along_axis(groups, chosen[..., None], 1)          # [R, k, G]
    ids = chosen[..., None] * group + jnp.arange(group, dtype=chosen.dtype)
    top, where = jax.lax.top_k(members.reshape(r, k * group), k)        # [R, k]
    return top, jnp.take_along_axis(ids.reshape(r, k * group), where, -1).astype(jnp.int32)


def groups_rows() -> bool:
    """Whether `top_k` may take the grouped top-k: on GPUs, unless switched off."""
    return jax.default_backend() == "gpu" and switches.current().top_k_grouped


def group_size(v: int, k: int) -> int | None:
    """The group length `top_k` cuts rows of v into, or None: the power of two nearest
    sqrt(V / k) (it balances the two TopKs' rows, V / G and k * G), within [32, 1024],
    for k >= 2 (an argmax, k = 1, gains nothing from it) and at least 4 k groups."""
    if k < 2 or not groups_rows():
        return None
    g = 1 << max(5, min(10, round(math.log2(max(v / k, 1)) / 2)))
    return g if -(-v // g) >= 4 * k else None


def splits_rows() -> bool:
    """Whether `top_k` may split rows: on GPUs, unless switched off."""
    return jax.default_backend() == "gpu" and switches.current().top_k_split


def split_chunk(rows: int, v: int, k: int) -> int | None:
    """The chunk length `top_k` splits rows of v into, or None for one pass: as many
    chunks as there are multiprocessors per row (one wave), at least 2, each at least
    MIN_CHUNK and 4 k long, rounded up to a multiple of 128."""
    if not splits_rows():
        return None
    sms = getattr(jax.devices()[0], "core_count", None) or DEFAULT_MULTIPROCESSORS
    n = min(sms // max(rows, 1), v // max(MIN_CHUNK, 4 * k))
    if n < 2:
        return None
    per_chunk = -(-v // n)
    return -(-per_chunk // 128) * 128


def top_k(x: jax.Array, k: int):
    """lax.top_k over the last axis of x [..., V] -> (values [..., k], indices [..., k]
    int32): grouped where `group_size` says so, else in two stages where `split_chunk`
    does. Leading axes are flattened first: XLA's CPU backend keeps its TopK kernel only
    for rank-2 operands (a higher rank becomes a full sort of the row)."""
    lead, v = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, v)
    group = group_size(v, k)
    chunk = split_chunk(flat.shape[0], v, k) if group is None else None
    if group is not None:
        values, ids = grouped_top_k(flat, k, group)
    elif chunk is None:
        values, ids = jax.lax.top_k(flat, k)
    else:
        values, ids = two_stage_top_k(flat, k, chunk)
    return values.reshape(lead + (k,)), ids.reshape(lead + (k,)).astype(jnp.int32)
