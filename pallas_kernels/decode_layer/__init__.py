"""A decoder layer in four kernels for the few rows of a decode step: the element-wise work
of a pre-norm SwiGLU layer (RMSNorm, Qwen3's per-head q/k norm, RoPE, SiLU, the residual
adds) folded into the matmuls around the attention.

  norm_qkv_rope(x, ...)     -> q, k, v   rms_norm, the three projections, q/k norm, RoPE
  (attention: `ragged_paged_attention`)
  matmul_residual(o, W_o, x) -> x'       the output projection and the residual add
  norm_swiglu(x', ...)      -> a         rms_norm, gate and up, silu(gate) * up
  matmul_residual(a, W_down, x') -> x''

Implementations: "xla" (reference.py, plain JAX: the documentation of the ops, and what
the unfused layer computes), "pallas_gpu" (gpu.py, Pallas Triton lowering for Hopper);
"auto" picks pallas_gpu on CUDA and xla elsewhere (a TPU's decode step is not
launch-bound the same way, and its layers stay XLA's). Weights are [out, in] as in the
checkpoints; activations bf16 or f32, weights in the same dtype.

Shape legend: R rows (batch x tokens), D hidden, N query heads, K kv heads, H head dim,
F MLP width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..platform import backend_implementation
from .reference import (matmul_residual_reference, norm_qkv_rope_reference,
                        norm_swiglu_reference)

__all__ = ["norm_qkv_rope", "norm_swiglu", "matmul_residual", "IMPLEMENTATIONS",
           "norm_qkv_rope_reference", "norm_swiglu_reference", "matmul_residual_reference"]

IMPLEMENTATIONS = ("auto", "xla", "pallas_gpu")
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _fail(op, what):
    raise ValueError(f"{op}: {what}")


def _check_common(op, implementation, x, weights):
    if implementation not in IMPLEMENTATIONS:
        _fail(op, f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if x.ndim != 2:
        _fail(op, f"x must be [R, D], got shape {x.shape}")
    if jnp.dtype(x.dtype) not in DTYPES:
        _fail(op, f"x dtype must be bfloat16 or float32, got {x.dtype}")
    for name, w in weights.items():
        if w.ndim != 2 or w.shape[1] != x.shape[1]:
            _fail(op, f"{name} must be [out, {x.shape[1]}], got shape {w.shape}")
        if w.dtype != x.dtype:
            _fail(op, f"{name} dtype {w.dtype} differs from x's {x.dtype}")
    if implementation == "pallas_gpu" and x.shape[1] % 16:
        _fail(op, f"implementation='pallas_gpu' needs the input width % 16 == 0, "
                  f"got {x.shape[1]}")


def _resolve(implementation: str) -> str:
    if implementation != "auto":
        return implementation
    return "pallas_gpu" if backend_implementation() == "pallas_gpu" else "xla"


@functools.partial(jax.jit, static_argnames=("eps", "implementation", "interpret"))
def norm_qkv_rope(x, norm_weight, wq, wk, wv, cos, sin, q_norm=None, k_norm=None, *,
                  eps: float, implementation: str = "auto", interpret: bool = False):
    """(q [R, N*H], k [R, K*H], v [R, K*H]) in x's dtype.

    x [R, D] the layer's input (the residual stream); norm_weight [D]; wq [N*H, D],
    wk/wv [K*H, D]; cos/sin [R, H/2] float32, each row's rotation (attention scaling
    included); q_norm/k_norm [H] (both or neither): per-head RMSNorm before RoPE."""
    op = "norm_qkv_rope"
    _check_common(op, implementation, x, {"wq": wq, "wk": wk, "wv": wv})
    r, d = x.shape
    if cos.shape != sin.shape or cos.ndim != 2 or cos.shape[0] != r:
        _fail(op, f"cos and sin must both be [R, H/2] = [{r}, H/2], got {cos.shape} and "
                  f"{sin.shape}")
    head_dim = 2 * cos.shape[1]
    if wq.shape[0] % head_dim or wk.shape[0] % head_dim or wk.shape != wv.shape:
        _fail(op, f"wq [N*H, D] and wk = wv [K*H, D] must hold whole heads of H = {head_dim}, "
                  f"got {wq.shape}, {wk.shape}, {wv.shape}")
    if (q_norm is None) != (k_norm is None):
        _fail(op, "q_norm and k_norm go together")
    if q_norm is not None and (q_norm.shape != (head_dim,) or k_norm.shape != (head_dim,)):
        _fail(op, f"q_norm and k_norm must be [H] = [{head_dim}], got {q_norm.shape} and "
                  f"{k_norm.shape}")
    if norm_weight.shape != (d,):
        _fail(op, f"norm_weight must be [D] = [{d}], got {norm_weight.shape}")
    cos, sin = cos.astype(jnp.float32), sin.astype(jnp.float32)
    if _resolve(implementation) == "xla":
        return norm_qkv_rope_reference(x, norm_weight, wq, wk, wv, cos, sin, eps=eps,
                                       q_norm=q_norm, k_norm=k_norm)
    if head_dim // 2 < 16:
        _fail(op, f"implementation='pallas_gpu' needs H >= 32, got {head_dim}")
    from .gpu import norm_qkv_rope_gpu
    return tuple(norm_qkv_rope_gpu(x, norm_weight, wq, wk, wv, cos, sin, eps=eps,
                                   q_norm=q_norm, k_norm=k_norm, interpret=interpret))


@functools.partial(jax.jit, static_argnames=("eps", "implementation", "interpret"))
def norm_swiglu(x, norm_weight, w_gate, w_up, *, eps: float, implementation: str = "auto",
                interpret: bool = False):
    """silu(rms_norm(x) @ w_gate^T) * (rms_norm(x) @ w_up^T): [R, F] in x's dtype.
    x [R, D], norm_weight [D], w_gate/w_up [F, D]."""
    op = "norm_swiglu"
    _check_common(op, implementation, x, {"w_gate": w_gate, "w_up": w_up})
    if w_gate.shape != w_up.shape:
        _fail(op, f"w_gate and w_up must have one shape, got {w_gate.shape} and {w_up.shape}")
    if norm_weight.shape != (x.shape[1],):
        _fail(op, f"norm_weight must be [D] = [{x.shape[1]}], got {norm_weight.shape}")
    if _resolve(implementation) == "xla":
        return norm_swiglu_reference(x, norm_weight, w_gate, w_up, eps=eps)
    if w_gate.shape[0] % 16:
        _fail(op, f"implementation='pallas_gpu' needs F % 16 == 0, got {w_gate.shape[0]}")
    from .gpu import norm_swiglu_gpu
    return norm_swiglu_gpu(x, norm_weight, w_gate, w_up, eps=eps, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("implementation", "interpret"))
def matmul_residual(a, weight, residual, *, implementation: str = "auto",
                    interpret: bool = False):
    """residual + a @ weight^T: [R, O] in the residual's dtype. a [R, I], weight [O, I],
    residual [R, O]."""
    op = "matmul_residual"
    _check_common(op, implementation, a, {"weight": weight})
    if residual.shape != (a.shape[0], weight.shape[0]):
        _fail(op, f"residual must be [R, O] = [{a.shape[0]}, {weight.shape[0]}], "
                  f"got {residual.shape}")
    if _resolve(implementation) == "xla":
        return matmul_residual_reference(a, weight, residual)
    if weight.shape[0] % 16:
        _fail(op, f"implementation='pallas_gpu' needs O % 16 == 0, got {weight.shape[0]}")
    from .gpu import matmul_residual_gpu
    return matmul_residual_gpu(a, weight, residual, interpret=interpret)
