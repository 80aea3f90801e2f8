"""Paged KV caches: a page pool per model, a page table per sequence.

Each layer keeps its keys and values in pools [P, PS, K, H]. Row b's position p lives in
page page_table[b, p // PS], slot p % PS; row b holds valid entries at positions
[0, lengths[b]). A forward writes its new tokens past that length; rolling back
(speculative decoding's rejected tokens) is a smaller `lengths`, and what lies past it is
never read (attention stops at the length) and is overwritten by the next write.

Which pages a sequence owns is host-side bookkeeping (`dspine_jax.page_pool`); the device
sees only the page table. Table entries past a row's pages hold P, out of range, so a stray write
there is dropped by the scatter instead of landing on another row's page.

Shape legend: B batch, T new tokens, P pages in the pool, PS page size, PPS pages per row
(the page table's width), S = PPS * PS a row's capacity, K kv heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dspine_jax.config import TargetConfig
from dspine_jax.page_pool import DEFAULT_PAGE_SIZE, pages_needed

@struct.dataclass
class PagedKVCache:
    k_pages: tuple[jax.Array, ...]  # per layer [P, PS, K, H]
    v_pages: tuple[jax.Array, ...]  # per layer [P, PS, K, H]
    page_table: jax.Array           # [B, PPS] int32
    lengths: jax.Array              # [B] int32

    @property
    def page_size(self) -> int:
        return self.k_pages[0].shape[1]

    @property
    def num_pages(self) -> int:
        return self.k_pages[0].shape[0]

    @property
    def capacity(self) -> int:
        """Positions the page table can address per row (S)."""
        return self.page_table.shape[1] * self.page_size

    @property
    def batch_size(self) -> int:
        return self.page_table.shape[0]

    @classmethod
    def create(cls, config: TargetConfig, page_table, num_pages: int, *,
               page_size: int = DEFAULT_PAGE_SIZE, dtype=jnp.float32,
               fill: float = 0.0) -> "PagedKVCache":
        """Empty pools for `config`'s layers over a page table [B, PPS]. Tests fill
        with NaN so that any read past a length shows up in the outputs."""
        shape = (num_pages, page_size, config.num_key_value_heads, config.head_dim)
        layers = range(config.num_hidden_layers)
        page_table = jnp.asarray(page_table, jnp.int32)
        return cls(k_pages=tuple(jnp.full(shape, fill, dtype) for _ in layers),
                   v_pages=tuple(jnp.full(shape, fill, dtype) for _ in layers),
                   page_table=page_table,
                   lengths=jnp.zeros((page_table.shape[0],), jnp.int32))

    @classmethod
    def contiguous(cls, config: TargetConfig, batch_size: int, capacity: int,
                   dtype=jnp.float32, *, page_size: int = DEFAULT_PAGE_SIZE,
                   fill: float = 0.0) -> "PagedKVCache":
        """Row b owns pages b * PPS .. (b + 1) * PPS - 1: for one-off forwards and tests."""
        width = pages_needed(capacity, page_size)
        table = np.arange(batch_size * width, dtype=np.int32).reshape(batch_size, width)
        return cls.create(config, table, batch_size * width, page_size=page_size,
                          dtype=dtype, fill=fill)

    def rollback(self, lengths: jax.Array) -> "PagedKVCache":
        """Forget every entry at or past `lengths` [B] (pages stay with their rows)."""
        return self.replace(lengths=jnp.minimum(self.lengths, lengths))

    def dense(self, layer: int):
        """Layer `layer`'s keys and values as [B, S, K, H] views (tests, debugging)."""
        return (gather_pages(self.k_pages[layer], self.page_table),
                gather_pages(self.v_pages[layer], self.page_table))


def write_pages(pages: jax.Array, new: jax.Array, page_table: jax.Array,
                positions: jax.Array, valid: jax.Array) -> jax.Array:
    """Scatter new [B, T, K, H] into pages [P, PS, K, H] at positions [B, T] where valid
    [B, T]. Invalid tokens, and positions past the page table, are dropped."""
    num_pages, page_size = pages.shape[:2]
    width = page_table.shape[1]
    entry = positions // page_size
    page = jnp.take_along_axis(page_table, jnp.clip(entry, 0, width - 1), axis=1)
    page = jnp.where(valid & (entry < width), page, num_pages)  # out of range: dropped
    return pages.at[page, positions % page_size].set(new.astype(pages.dtype), mode="drop")


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """[P, PS, K, H] pools, [B, PPS] table -> [B, S, K, H], each row's pages in order.
    Out-of-range entries read a clamped page: callers mask positions past the length."""
    b, width = page_table.shape
    _, page_size, k, h = pages.shape
    return jnp.take(pages, page_table, axis=0, mode="clip").reshape(b, width * page_size, k, h)
