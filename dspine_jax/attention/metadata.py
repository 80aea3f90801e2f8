"""What one forward's attention needs to know, built once and handed to every layer.

Two kinds of call:
  paged  this call's T tokens per row are written into a paged KV cache past the row's
         current length and attend over it (target prefill / decode / verify; the
         drafter's block against its context cache);
  dense  keys and values are passed in full with an explicit mask (forwards without a
         cache: the target's feature pass, drafter training).

Masks (`mask`):
  causal               a query at position p sees keys [0, p] (the target);
  causal_block         the same, for a drafted block after a context prefix (DSpine);
  bidirectional_block  every query of the block sees the whole prefix and the whole
                       block, keys [0, kv_len) (DFlash);
  block_diagonal       training's packed blocks: each sees its own prefix and block only
                       (dense only; the mask array says which keys).

Shape legend: B batch, T query tokens, S keys, PPS pages per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

MASKS = ("causal", "causal_block", "bidirectional_block", "block_diagonal")


@struct.dataclass
class AttentionMetadata:
    positions: jax.Array            # [B, T] absolute position of each query (RoPE, causality)
    q_lens: jax.Array               # [B] valid queries per row; the rest are padding
    kv_lens: jax.Array | None       # [B] paged: keys valid after this call's write
    page_table: jax.Array | None    # [B, PPS] paged: the rows' pages
    dense_mask: jax.Array | None    # [B, T, S] dense: which keys each query sees
    mask: str = struct.field(pytree_node=False, default="causal")

    def __post_init__(self):
        if self.mask not in MASKS:
            raise ValueError(f"attention mask must be one of {MASKS}, got {self.mask!r}")

    @property
    def is_paged(self) -> bool:
        return self.page_table is not None

    @property
    def write_mask(self) -> jax.Array:
        """[B, T] which of this call's tokens are real (written to the cache)."""
        t = self.positions.shape[1]
        return jnp.arange(t)[None, :] < self.q_lens[:, None]

    @classmethod
    def paged(cls, lengths: jax.Array, page_table: jax.Array, num_tokens: int,
              q_lens: jax.Array | None = None, mask: str = "causal") -> "AttentionMetadata":
        """T = num_tokens queries per row at lengths[b] + 0..T-1, of which the first
        q_lens[b] (default all) are real and get written."""
        b = lengths.shape[0]
        q_lens = (jnp.full((b,), num_tokens, jnp.int32) if q_lens is None
                  else q_lens.astype(jnp.int32))
        positions = lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
        return cls(positions=positions, q_lens=q_lens, kv_lens=lengths + q_lens,
                   page_table=page_table, dense_mask=None, mask=mask)

    @classmethod
    def dense(cls, positions: jax.Array, dense_mask: jax.Array,
              mask: str = "causal") -> "AttentionMetadata":
        b, t = positions.shape
        return cls(positions=positions, q_lens=jnp.full((b,), t, jnp.int32), kv_lens=None,
                   page_table=None, dense_mask=dense_mask, mask=mask)

    @classmethod
    def causal(cls, positions: jax.Array) -> "AttentionMetadata":
        """Causal self-attention over T tokens at `positions` [B, T], no cache."""
        t = positions.shape[1]
        # [B, T, S=T]: not after the query, by position and by index (equal positions of
        # right padding stay causal)
        visible = positions[:, None, :] <= positions[:, :, None]
        visible &= (jnp.arange(t)[None, :] <= jnp.arange(t)[:, None])[None]
        return cls.dense(positions, visible, "causal")

    def paged_mask(self, num_keys: int) -> jax.Array:
        """[B, T, S] the paged call's mask over a row's first S = num_keys positions."""
        key = jnp.arange(num_keys, dtype=jnp.int32)
        visible = key[None, None, :] < self.kv_lens[:, None, None]
        if self.mask in ("causal", "causal_block"):
            visible &= key[None, None, :] <= self.positions[:, :, None]
        return visible
