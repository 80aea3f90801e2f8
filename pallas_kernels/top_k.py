"""Exact lax.top_k over long rows (a vocabulary), shaped for a GPU's TopK.

`top_k(x, k)` returns what lax.top_k(x, k) returns, ties to the lower index. XLA's GPU
TopK runs one thread block per row, so a few long rows leave the GPU idle and many short
rows pay a fixed cost each. On a GPU, therefore:
  * k >= 2: `grouped_top_k` cuts each row into groups of G, one reduction takes every
    group's maximum, a selection over the maxima picks the k groups that can hold the
    row's top-k, and a selection over their k * G entries finishes. Each selection is
    a sort on (value descending, index ascending) of a row of ~1,000 (one shared-memory
    sort kernel; half the time of XLA's TopK on an H100), or XLA's TopK with the switch
    `top_k_select=topk`;
  * k = 1, or rows too short to group: when the rows are too few to fill the GPU,
    `two_stage_top_k` splits each into as many chunks as fill one wave (each at least
    MIN_CHUNK long), takes each chunk's top-k, then the top-k of the survivors.
Elsewhere (CPU, TPU) one lax.top_k. Both paths are exact: an entry of the row's top-k is
in the top-k of its own group or chunk, and survivors keep index order. The switches
`top_k_grouped`, `top_k_split` and `top_k_select` (`pallas_kernels.switches`;
DSPINE_TOP_K_GROUPED=0, DSPINE_TOP_K_SPLIT=0, DSPINE_TOP_K_SELECT=topk) turn the paths
off or back to XLA's TopK (docs/benchmarks.md, "Engine options").

Shape legend: R rows, V row length, C chunk, n = ceil(V / C) chunks; G group, n = ceil(V / G)
groups; N a selection's row length.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import switches
from pallas_kernels.platform import multiprocessors

MIN_CHUNK = 1024


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


def sorted_top_k(x: jax.Array, ids: jax.Array, k: int):
    """x [R, N] and its entries' distinct ids [R, N] int32 -> (values [R, k], ids [R, k]):
    the k largest values, equal values lower id first, by one sort on the key pair
    (value descending, id ascending), a total order since the ids are distinct. The value
    key is -x for floats (x + 0 first, so -0.0 and +0.0 tie, as they do in lax.top_k) and
    ~x for integers (no overflow); values come back as the key's inverse, so a -0.0 in
    the result reads +0.0."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        key = -(x + jnp.zeros((), x.dtype))
        undo = jnp.negative
    else:
        key = jnp.invert(x)
        undo = jnp.invert
    key, ids = jax.lax.sort((key, ids), dimension=-1, num_keys=2, is_stable=False)
    return undo(key[:, :k]), ids[:, :k]


def _select(x: jax.Array, k: int, ids: jax.Array | None = None):
    """The top k of x [R, N] and their ids [R, N] (None: their positions), by the switch's
    selection; XLA's TopK needs ids that ascend along each row for its ties to go to the
    lower id."""
    if switches.current().top_k_select == "sort":
        if ids is None:
            ids = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)
        return sorted_top_k(x, ids, k)
    values, where = jax.lax.top_k(x, k)
    return values, where if ids is None else jnp.take_along_axis(ids, where, -1)


def grouped_top_k(x: jax.Array, k: int, group: int):
    """x [R, V], static k <= ceil(V / group) -> (values [R, k], indices [R, k] int32), as
    lax.top_k(x, k). Exact, ties included: a group whose maximum ranks below the k-th
    group's cannot hold a top-k entry (each group ranked above it holds an entry ranked
    above all of its own), and groups are contiguous, so ranking maxima by (value, lower
    group first) ranks them as lax.top_k ranks entries. The last selection's ties go to
    the lower index: the sort keys on it, and for XLA's TopK the chosen groups are put
    back in index order first."""
    r, v = x.shape
    n = -(-v // group)
    if not 1 <= k <= n:
        raise ValueError(f"grouped_top_k needs 1 <= k <= ceil(V / group) ({n}), got k={k}")
    padded = jnp.pad(x, ((0, 0), (0, n * group - v)), constant_values=_lowest(x.dtype))
    groups = padded.reshape(r, n, group)                                 # [R, n, G]
    _, chosen = _select(groups.max(-1), k)                               # [R, k]
    if switches.current().top_k_select != "sort":
        chosen = jnp.sort(chosen, axis=-1)
    members = jnp.take_along_axis(groups, chosen[..., None], 1)          # [R, k, G]
    ids = chosen[..., None] * group + jnp.arange(group, dtype=jnp.int32)
    return _select(members.reshape(r, k * group), k, ids.reshape(r, k * group))


def groups_rows() -> bool:
    """Whether `top_k` may take the grouped top-k: on GPUs, unless switched off."""
    return jax.default_backend() == "gpu" and switches.current().top_k_grouped


def group_size(v: int, k: int) -> int | None:
    """The group length `top_k` cuts rows of v into on this backend, or None: see
    `group_length`."""
    return group_length(v, k) if groups_rows() else None


def group_length(v: int, k: int) -> int | None:
    """The group length for rows of v, or None: the power of two nearest sqrt(V / k) (it
    balances the two selections' rows, V / G and k * G), within [32, 1024], for k >= 2
    (an argmax, k = 1, gains nothing from it) and at least 4 k groups."""
    if k < 2:
        return None
    g = 1 << max(5, min(10, round(math.log2(max(v / k, 1)) / 2)))
    return g if -(-v // g) >= 4 * k else None


def splits_rows() -> bool:
    """Whether `top_k` may split rows: on GPUs, unless switched off."""
    return jax.default_backend() == "gpu" and switches.current().top_k_split


def split_chunk(rows: int, v: int, k: int) -> int | None:
    """The chunk length `top_k` splits rows of v into on this backend, or None for one
    pass: see `chunk_length`, with this device's multiprocessors."""
    if not splits_rows():
        return None
    return chunk_length(rows, v, k, multiprocessors())


def chunk_length(rows: int, v: int, k: int, multiprocessors: int) -> int | None:
    """The chunk length for `rows` rows of v, or None for one pass: as many chunks as
    there are multiprocessors per row (one wave), at least 2, each at least MIN_CHUNK and
    4 k long, rounded up to a multiple of 128."""
    n = min(multiprocessors // max(rows, 1), v // max(MIN_CHUNK, 4 * k))
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
