"""What a cross-entropy over an lm_head needs, without writing its logits out.

`lm_head_stats(hidden, weight, labels)`: for logits = hidden @ weight^T ([R, V], weight in
hidden's dtype, products accumulated in float32), per row
  * lse: logsumexp over the vocabulary (the log-normaliser; CE = lse - label_logit),
  * label_logit: hidden . weight[label],
  * rank: the entries lax.top_k puts before the label (greater, or equal at a lower id),
    so rank < C says "the label is among the top C" and rank == 0 "it is the argmax"
    (near-ties within float32 rounding of the label's logit may count either way).
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


@functools.partial(jax.jit, static_argnames=("implementation", "chunk", "interpret"))
def lm_head_stats(hidden, weight, labels, *, implementation="auto", chunk=DEFAULT_CHUNK,
                  interpret=False):
    """Args:
      hidden: [R, D] bf16/f32.
      weight: [V, D] bf16/f32, cast to hidden's dtype; treated as a constant.
      labels: [R] integer ids in [0, V).
      implementation: "auto" | "xla" | "pallas_gpu" | "pallas_tpu" (the forward).
      chunk: vocabulary columns per step of the xla passes (static).
      interpret: run a Pallas forward in interpret mode (CPU tests).

    Returns:
      (lse [R] float32, label_logit [R] float32, rank [R] int32).
    """
    check_inputs(hidden, weight, labels, implementation, chunk)
    if implementation == "auto":
        implementation = backend_implementation()
    return _stats(hidden, jax.lax.stop_gradient(weight), labels.astype(jnp.int32),
                  implementation, chunk, interpret)


def _forward(hidden, weight, labels, implementation, chunk, interpret):
    value = label_logits(hidden, weight, labels)
    if implementation == "xla":
        lse, rank = forward_xla(hidden, weight, labels, value, chunk)
    elif implementation == "pallas_gpu":
        from .gpu import forward_gpu
        lse, rank = combine(*forward_gpu(hidden, weight, labels, value, interpret=interpret))
    else:
        from .tpu import forward_tpu
        lse, rank = combine(*forward_tpu(hidden, weight, labels, value, interpret=interpret))
    return lse, value, rank


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _stats(hidden, weight, labels, implementation, chunk, interpret):
    return _forward(hidden, weight, labels, implementation, chunk, interpret)


def _stats_fwd(hidden, weight, labels, implementation, chunk, interpret):
    out = _forward(hidden, weight, labels, implementation, chunk, interpret)
    return out, (hidden, weight, labels, out[0])


def _stats_bwd(implementation, chunk, interpret, residuals, cotangents):
    hidden, weight, labels, lse = residuals
    g_lse, g_value, _ = cotangents          # rank is an integer: no cotangent
    grad = backward_xla(hidden, weight, labels, lse, g_lse, g_value, chunk)
    return grad, None, None


_stats.defvjp(_stats_fwd, _stats_bwd)
