"""What a cross-entropy over an lm_head needs, without writing its logits out.

`lm_head_stats(hidden, weight, labels)`: for logits = hidden @ weight^T ([R, V], weight in
hidden's dtype, products accumulated in float32), per row
  * lse: logsumexp over the vocabulary (the log-normaliser; CE = lse - label_logit),
  * label_logit: hidden . weight[label],
  * rank: the entries lax.top_k puts before the label (greater, or equal at a lower id),
    so rank < C says "the label is among the top C" and rank == 0 "it is the argmax"
    (near-ties within float32 rounding of the label's logit may count either way).
With top_k = C > 0 it also returns the C largest logits' ids per row (value descending,
ties to the lower id: `dspine_proposal.vocab_top_k`'s), from the same pass over the
lm_head on a GPU.

Differentiable in `hidden` through a custom VJP: d lse = softmax(logits) @ weight,
recomputed one vocabulary chunk at a time (one more product in place of storing the
[R, V] logits and their gradient), d label_logit = weight[label]. The weight is a constant
(the frozen lm_head of the drafters' target): no gradient reaches it.

Implementations of the forward: "xla" (lax.scan over chunks of `chunk` vocabulary
columns: one [R, chunk] block of logits at a time; xla.py), "pallas_gpu" (gpu.py, Pallas
Triton lowering: each [BR, BV] tile of logits stays in registers, split over the
vocabulary), "pallas_tpu" (tpu.py, Mosaic TPU: tiles in VMEM); "auto" picks pallas_gpu
on CUDA, pallas_tpu on TPU and xla elsewhere. Every implementation's backward is the xla
chunks. reference.py builds the full logits and is differentiated by plain autodiff.

Shape legend: R rows, D hidden, V vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..platform import backend_implementation
from .common import IMPLEMENTATIONS, check_inputs, combine
from .reference import label_logits, lm_head_stats_reference
from .xla import backward_xla, forward_xla

__all__ = ["lm_head_stats", "lm_head_stats_reference", "IMPLEMENTATIONS", "DEFAULT_CHUNK"]

# Vocabulary columns per scan step of the xla passes: 6 steps over SmolLM2's 49,152.
DEFAULT_CHUNK = 8192


@functools.partial(jax.jit, static_argnames=("implementation", "chunk", "interpret",
                                             "top_k"))
def lm_head_stats(hidden, weight, labels, *, implementation="auto", chunk=DEFAULT_CHUNK,
                  interpret=False, top_k=0):
    """Args:
      hidden: [R, D] bf16/f32.
      weight: [V, D] bf16/f32, cast to hidden's dtype; treated as a constant.
      labels: [R] integer ids in [0, V).
      implementation: "auto" | "xla" | "pallas_gpu" | "pallas_tpu" (the forward).
      chunk: vocabulary columns per step of the xla passes (static).
      interpret: run a Pallas forward in interpret mode (CPU tests).
      top_k: static; > 0 also returns the top_k ids of each row's logits.

    Returns:
      (lse [R] float32, label_logit [R] float32, rank [R] int32), and with top_k the
      ids [R, top_k] int32 of the largest logits, value descending.
    """
    check_inputs(hidden, weight, labels, implementation, chunk)
    if not isinstance(top_k, int) or not 0 <= top_k <= weight.shape[0]:
        raise ValueError(f"lm_head_stats: top_k must be an int in 0..V={weight.shape[0]}, "
                         f"got {top_k!r}")
    if implementation == "auto":
        implementation = backend_implementation()
    out = _stats(hidden, jax.lax.stop_gradient(weight), labels.astype(jnp.int32),
                 implementation, chunk, interpret, top_k)
    return out if top_k else out[:3]


def _forward(hidden, weight, labels, implementation, chunk, interpret, top_k):
    """(lse, label_logit, rank, top-k ids [R, top_k], empty without top_k)."""
    value = label_logits(hidden, weight, labels)
    ids = jnp.zeros((hidden.shape[0], 0), jnp.int32)
    if implementation == "pallas_gpu":
        from .gpu import forward_gpu
        partials = forward_gpu(hidden, weight, labels, value, top_k=top_k,
                               interpret=interpret)
        if top_k:
            partials, ids = partials
        lse, rank = combine(*partials)
        return lse, value, rank, ids
    if implementation == "xla":
        lse, rank = forward_xla(hidden, weight, labels, value, chunk)
    else:
        from .tpu import forward_tpu
        lse, rank = combine(*forward_tpu(hidden, weight, labels, value, interpret=interpret))
    if top_k:       # a second pass over the lm_head: vocab_top_k's own kernel
        from ..dspine_proposal import vocab_top_k
        ids = vocab_top_k(hidden, weight, top_k, implementation=implementation,
                          interpret=interpret)[1]
    return lse, value, rank, ids


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _stats(hidden, weight, labels, implementation, chunk, interpret, top_k):
    return _forward(hidden, weight, labels, implementation, chunk, interpret, top_k)


def _stats_fwd(hidden, weight, labels, implementation, chunk, interpret, top_k):
    out = _forward(hidden, weight, labels, implementation, chunk, interpret, top_k)
    return out, (hidden, weight, labels, out[0])


def _stats_bwd(implementation, chunk, interpret, top_k, residuals, cotangents):
    hidden, weight, labels, lse = residuals
    g_lse, g_value = cotangents[:2]         # rank and ids are integers: no cotangent
    grad = backward_xla(hidden, weight, labels, lse, g_lse, g_value, chunk)
    return grad, None, None


_stats.defvjp(_stats_fwd, _stats_bwd)
