"""Host-side page bookkeeping of paged KV caches: which pages each sequence owns.

Imports no JAX: the engine's scheduler (`dspine_jax.runtime.scheduler`) keeps its page
accounting with it, and the device only ever sees the page table it writes
(`dspine_jax.kv_cache`).
"""

from __future__ import annotations

import numpy as np

from dspine_jax.errors import DSpineError

DEFAULT_PAGE_SIZE = 16


class OutOfPagesError(DSpineError, RuntimeError):
    """The page pool cannot hold what a request needs."""


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class PagePool:
    """Host-side allocator of one pool's pages to sequences (any hashable id).

    Models that share a page table (a target and its drafter's context) share one pool:
    the same page ids index each model's own pools.
    """

    def __init__(self, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"a page pool needs num_pages >= 1 and page_size >= 1, got "
                             f"{num_pages} and {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._owned: dict = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages(self, seq) -> list[int]:
        return list(self._owned.get(seq, ()))

    def allocate(self, seq, num_tokens: int) -> list[int]:
        """Grow `seq` to hold `num_tokens` positions; returns its pages, in order."""
        owned = self._owned.setdefault(seq, [])
        more = pages_needed(num_tokens, self.page_size) - len(owned)
        if more > len(self._free):
            raise OutOfPagesError(
                f"out of KV pages: sequence {seq!r} needs {more} more page(s) of "
                f"{self.page_size} tokens for {num_tokens} positions, but only "
                f"{len(self._free)} of the pool's {self.num_pages} pages are free; use a "
                "larger pool (num_pages), a smaller batch or fewer new tokens")
        owned.extend(self._free.pop() for _ in range(max(0, more)))
        return list(owned)

    def rollback(self, seq, length: int) -> None:
        """Keep positions [0, length): whole pages past it return to the pool."""
        owned = self._owned.get(seq, [])
        keep = pages_needed(length, self.page_size)
        while len(owned) > keep:
            self._free.append(owned.pop())

    def free(self, seq) -> None:
        self.rollback(seq, 0)
        self._owned.pop(seq, None)

    def page_table(self, seqs, width: int) -> np.ndarray:
        """[len(seqs), width] int32: each sequence's pages, then P (out of range)."""
        table = np.full((len(seqs), width), self.num_pages, np.int32)
        for row, seq in enumerate(seqs):
            pages = self._owned.get(seq, [])
            if len(pages) > width:
                raise ValueError(f"sequence {seq!r} owns {len(pages)} pages, more than the "
                                 f"page table's width {width}")
            table[row, :len(pages)] = pages
        return table
