"""The target's KV cache: fixed capacity, per-row lengths.

Row b holds valid entries at positions [0, lengths[b]). A forward of T new tokens writes
them at lengths[b] .. lengths[b] + T - 1 and attends causally to everything up to itself.
Rolling back (speculative decoding's rejected tokens) is only a smaller `lengths`: entries
past it are masked out by causality and overwritten by the next write.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dspine_jax.config import TargetConfig


@struct.dataclass
class KVCache:
    keys: tuple[jax.Array, ...]    # per layer [B, S, K, H]
    values: tuple[jax.Array, ...]  # per layer [B, S, K, H]
    lengths: jax.Array             # [B] int32

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @classmethod
    def create(cls, config: TargetConfig, batch_size: int, capacity: int,
               dtype=jnp.float32) -> "KVCache":
        shape = (batch_size, capacity, config.num_key_value_heads, config.head_dim)
        layers = range(config.num_hidden_layers)
        return cls(keys=tuple(jnp.zeros(shape, dtype) for _ in layers),
                   values=tuple(jnp.zeros(shape, dtype) for _ in layers),
                   lengths=jnp.zeros((batch_size,), jnp.int32))

    def rollback(self, lengths: jax.Array) -> "KVCache":
        """Forget every entry at or past `lengths` [B]."""
        return self.replace(lengths=jnp.minimum(self.lengths, lengths))


def write_kv(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Scatter new [B, T, K, H] into cache [B, S, K, H] at positions [B, T].

    Out-of-range positions are dropped, never clamped onto valid entries; callers check
    capacity on the host before generating.
    """
    rows = jnp.arange(new.shape[0])[:, None]
    return cache.at[rows, positions].set(new.astype(cache.dtype), mode="drop")
