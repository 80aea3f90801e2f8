"""Decoder building blocks shared by the target models and the drafters.

Parameters keep HF's names and layouts ([out, in] weights), so checkpoints map one to one;
a decoder fuses q/k/v and gate/up into one weight each (`stacked_linear`) for inference.

Shape legend:
  B batch, T query length, S key length, D hidden, N query heads, K kv heads,
  G query heads per kv head (N = K * G), H head dim, F MLP width, V vocab.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx

# Finite, so a query whose every key is masked (a padding row) gives a uniform
# softmax instead of NaN; such rows are never read.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum_f32(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum accumulated and returned in float32 (logits, attention scores), whose
    gradient products run in the operands' own dtype. Plain autodiff would meet the
    float32 cotangent with the bf16 operands and run both backward matmuls in float32."""
    return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32)


def _einsum_f32_fwd(subscripts, a, b):
    return einsum_f32(subscripts, a, b), (a, b)


def _einsum_f32_bwd(subscripts, saved, g):
    a, b = saved
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(subscripts, a, b), a, b)
    return vjp(g.astype(jnp.result_type(a, b)))


einsum_f32.defvjp(_einsum_f32_fwd, _einsum_f32_bwd)


def _init(rngs: nnx.Rngs, shape, dtype, scale=0.02):
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype)


class Linear(nnx.Module):
    """y = x W^T (+ b), W stored [out, in] as in PyTorch checkpoints."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        self.weight = nnx.Param(_init(rngs, (out_features, in_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = project(x, self.weight[...])
        return y if self.bias is None else y + self.bias[...]


def project(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [..., in] @ weight [out, in]^T. XLA's product, or under the `verify_gemm` switch
    on a CUDA GPU `split_k_matmul` for 16 to 256 rows (a verify's projections)."""
    from pallas_kernels.platform import backend_implementation
    from pallas_kernels.switches import current

    if current().verify_gemm == "pallas" and backend_implementation() == "pallas_gpu":
        from pallas_kernels.split_k_matmul import MIN_ROWS, fits, split_k_matmul

        rows = math.prod(x.shape[:-1])
        if rows >= MIN_ROWS and x.dtype == weight.dtype and fits(rows, *weight.shape):
            y = split_k_matmul(x.reshape(rows, x.shape[-1]), weight)
            return y.reshape(*x.shape[:-1], weight.shape[0])
    return jnp.einsum("...i,oi->...o", x, weight)


def stacked_linear(*parts: Linear) -> Linear:
    """One Linear whose output is the parts' outputs side by side: their [out, in] weights
    (and biases) stacked along out. No weights are initialised on the way."""
    in_features = parts[0].weight.shape[1]
    bias = parts[0].bias is not None
    out = sum(p.weight.shape[0] for p in parts)
    stacked = nnx.eval_shape(lambda: Linear(in_features, out, bias=bias, rngs=nnx.Rngs(0)))
    stacked.weight = nnx.Param(_stack([p.weight.get_value() for p in parts]))
    if bias:
        stacked.bias = nnx.Param(_stack([p.bias.get_value() for p in parts]))
    return stacked


def _stack(arrays: list) -> jax.Array | jax.ShapeDtypeStruct:
    """Concatenated along the first axis; abstract (shapes only) where the parts are."""
    if any(isinstance(a, jax.ShapeDtypeStruct) for a in arrays):
        return jax.eval_shape(lambda *a: jnp.concatenate(a), *arrays)
    return jnp.concatenate(arrays)


def split_sizes(x, sizes: tuple[int, ...], axis: int = -1) -> list:
    """x's parts of these sizes along `axis`: a stacked Linear's outputs (the last axis) or
    its weight's rows (axis 0); numpy or JAX arrays alike."""
    bounds = [0, *itertools.accumulate(sizes)]
    lead = (slice(None),) * (axis % x.ndim)
    return [x[lead + (slice(a, b),)] for a, b in zip(bounds, bounds[1:])]


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.weight = nnx.Param(_init(rngs, (vocab_size, dim), dtype))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], tokens, axis=0)


class RMSNorm(nnx.Module):
    """HF's RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return x32.astype(x.dtype) * self.weight[...].astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, *, bias: bool = False, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.gate_proj = Linear(dim, hidden, bias=bias, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(dim, hidden, bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(hidden, dim, bias=bias, dtype=dtype, rngs=rngs)

    @property
    def fused(self) -> bool:
        return hasattr(self, "gate_up_proj")

    def fuse_projections(self) -> None:
        """For inference: gate_proj and up_proj become one gate_up_proj (rows stacked),
        one GEMM where there were two. Left apart, XLA's dot merger may stack the two
        weights into a new buffer on every call instead."""
        if not self.fused:
            self.gate_up_proj = stacked_linear(self.gate_proj, self.up_proj)
            del self.gate_proj, self.up_proj

    def gate_up_weights(self) -> tuple[jax.Array, jax.Array]:
        """The gate and up weights [F, D], fused or not."""
        if self.fused:
            return tuple(jnp.split(self.gate_up_proj.weight[...], 2))
        return self.gate_proj.weight[...], self.up_proj.weight[...]

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.fused:
            gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(jax.nn.silu(gate) * up)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                          mask: jax.Array) -> jax.Array:
    """Grouped-query attention: q [B, T, N, H], k/v [B, S, K, H], mask [B, T, S] -> [B, T, N, H].

    The reference every faster attention kernel is checked against. Scores and
    softmax run in float32.
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, n // kv_heads, h)
    # [B, K, G, T, S]
    scores = einsum_f32("BTKGH,BSKH->BKGTS", q, k)
    scores = jnp.where(mask[:, None, None], scores * (h ** -0.5), MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(b, t, n, h)
