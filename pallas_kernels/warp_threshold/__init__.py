"""A top-k/top-p warp's threshold per row of logits, without sorting the vocabulary.

`warp_threshold(scaled, k, top_p)`: for temperature-scaled logits [R, V] with per-row
k (V: no top-k) and top_p (1: no top-p), tau [R] such that the warp keeps exactly the
entries >= tau: reference.py's sort of each row is the definition. Implementations:
  "sort"        reference.py (XLA's sort of every row; a GPU's warp below 16 rows),
  "search"      search.py's two searches in plain JAX, branch-free,
  "pallas_gpu"  the same searches, each round one Pallas (Triton lowering) launch split
                over rows and vocabulary (gpu.py) that reads each row once, no
                [R, W, V] intermediate.
Speculative verification at T > 0 needs the threshold of every verified position
(batch x 16 rows of the whole vocabulary); the sort of those rows was what a top-p pass
cost over a greedy one.

R rows, V vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .reference import warp_threshold_reference
from .search import WAYS, search_threshold

__all__ = ["warp_threshold", "warp_threshold_reference", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("sort", "search", "pallas_gpu")


@functools.partial(jax.jit, static_argnames=("implementation", "ways", "interpret"))
def warp_threshold(scaled, k, top_p, *, implementation="sort", ways=WAYS, interpret=False):
    """Args:
      scaled: [R, V] float32 temperature-scaled logits.
      k: [R] integer, 1..V (V: no top-k).
      top_p: [R] float32 in (0, 1] (>= 1: no top-p).
      implementation: one of IMPLEMENTATIONS.
      ways: the searches' candidates per round, a power of two (search.py; the sort
        ignores it).
      interpret: run the Pallas kernel in interpret mode (CPU tests).

    Returns: tau [R] float32, each row's smallest kept value.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"warp_threshold: implementation must be one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    if scaled.ndim != 2 or k.shape != scaled.shape[:1] or top_p.shape != scaled.shape[:1]:
        raise ValueError(f"warp_threshold: scaled must be [R, V] with k and top_p [R]; got "
                         f"{scaled.shape}, {k.shape}, {top_p.shape}")
    scaled = scaled.astype(jnp.float32)
    k = k.astype(jnp.int32)
    top_p = top_p.astype(jnp.float32)
    if implementation == "sort":
        return warp_threshold_reference(scaled, k, top_p)
    if implementation == "search":
        return search_threshold(scaled, k, top_p, ways=ways)
    from .gpu import warp_threshold_gpu
    return warp_threshold_gpu(scaled, k, top_p, ways=ways, interpret=interpret)
