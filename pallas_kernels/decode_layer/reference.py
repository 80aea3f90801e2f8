"""The decode layer's three fused ops in plain JAX: the documentation of what the kernels
compute, step by step in the order and dtypes of the unfused layer (HF's RMSNorm, a
matmul whose result is rounded to the activations' dtype, RoPE in float32).

R rows, D hidden, N query heads, K kv heads, H head dim, F MLP width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x, weight, eps: float):
    """HF's RMSNorm over the last axis: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32.astype(x.dtype) * weight.astype(x.dtype)


def matmul(x, weight):
    """x [R, D] @ weight [O, D]^T, accumulated in float32, in x's dtype."""
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jnp.einsum("rd,od->ro", x, weight.astype(x.dtype), precision=precision,
                      preferred_element_type=jnp.float32).astype(x.dtype)


def rope(x, cos, sin):
    """x [R, n, H] rotated in HF's half-split layout by cos/sin [R, H/2] float32."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def norm_qkv_rope_reference(x, norm_weight, wq, wk, wv, cos, sin, *, eps, q_norm=None,
                            k_norm=None):
    """(q [R, N*H], k [R, K*H], v [R, K*H]): the attention's input projections of
    rms_norm(x), q and k normed per head (Qwen3's q_norm/k_norm, when given) and rotated."""
    r = x.shape[0]
    head_dim = 2 * cos.shape[-1]
    h = rms_norm(x, norm_weight, eps)

    def heads(w, norm, rotate):
        y = matmul(h, w).reshape(r, -1, head_dim)
        if norm is not None:
            y = rms_norm(y, norm, eps)
        return (rope(y, cos, sin) if rotate else y).reshape(r, -1)

    return heads(wq, q_norm, True), heads(wk, k_norm, True), heads(wv, None, False)


def norm_swiglu_reference(x, norm_weight, w_gate, w_up, *, eps):
    """silu(rms_norm(x) @ w_gate^T) * (rms_norm(x) @ w_up^T): [R, F] in x's dtype."""
    h = rms_norm(x, norm_weight, eps)
    return jax.nn.silu(matmul(h, w_gate)) * matmul(h, w_up)


def matmul_residual_reference(a, weight, residual):
    """residual + a @ weight^T: [R, D] in the residual's dtype."""
    return residual + matmul(a, weight).astype(residual.dtype)
