"""DSpine's gated adjacent injection (design doc 2.2) and the refined state of 2.5.

After draft layer l every block slot i >= 1 receives its predecessor's feature p_i:
    g = sigmoid(A phi_l(h_i) + B p_i + b),  u = M p_i,  h_i += rms(h_i) * W_l (g * u)
with phi_l(h) = sqrt(r) * normalise(R_l h). W_l and B, b start at zero, so a fresh DSpine
computes exactly what DFlash computes.

Shape legend: ... leading dims (batch, block, slot, candidates), H hidden, r transfer
rank, m message size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspine_jax.layers import Linear


class Injection(nnx.Module):
    """Parameter names follow the reference (`injection.readouts.{l}.weight`, ...)."""

    def __init__(self, hidden: int, rank: int, message: int, num_layers: int, *, dtype,
                 rngs: nnx.Rngs):
        self.rank = rank
        self.readouts = nnx.List([Linear(hidden, rank, dtype=dtype, rngs=rngs)
                                  for _ in range(num_layers)])  # R_l, set to D^T later
        self.writes = nnx.List([Linear(message, hidden, dtype=dtype, rngs=rngs)
                                for _ in range(num_layers)])    # W_l
        self.message = Linear(rank, message, dtype=dtype, rngs=rngs)           # M
        self.receiver_gate = Linear(rank, message, dtype=dtype, rngs=rngs)     # A
        self.predecessor_gate = Linear(rank, message, dtype=dtype, rngs=rngs)  # B
        self.bias = nnx.Param(jnp.zeros((message,), dtype))                    # b
        for write in self.writes:
            write.weight[...] = jnp.zeros_like(write.weight[...])
        self.predecessor_gate.weight[...] = jnp.zeros_like(self.predecessor_gate.weight[...])

    def feature(self, layer: int, h: jax.Array) -> jax.Array:
        """phi_l(h) [..., r] float32: the hidden state read into the transfer space."""
        z = self.readouts[layer](h).astype(jnp.float32)
        return jnp.sqrt(self.rank) * z / jnp.maximum(jnp.linalg.norm(z, axis=-1, keepdims=True),
                                                     1e-6)

    def write(self, layer: int, h: jax.Array, phi_h: jax.Array, pred: jax.Array):
        """The residual write for hidden h [..., H] given its own feature and its
        predecessor's p [..., r]. Returns (delta [..., H], gate [..., m])."""
        dtype = h.dtype
        gate = jax.nn.sigmoid((self.receiver_gate(phi_h.astype(dtype))
                               + self.predecessor_gate(pred.astype(dtype))
                               + self.bias[...]).astype(jnp.float32))
        msg = self.message(pred.astype(dtype)).astype(jnp.float32)
        h32 = h.astype(jnp.float32)
        rms = jnp.sqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True))
        delta = rms * self.writes[layer]((gate * msg).astype(dtype)).astype(jnp.float32)
        return delta.astype(dtype), gate
