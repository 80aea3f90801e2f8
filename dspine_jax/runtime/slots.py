"""Host-side bookkeeping of the engine core's slots and of the one page pool they share.

A slot is a row of the device state; the pages it holds are listed in its row of the page
table [S, PPS] (entries past its pages hold the pool size, out of range, so a stray write
is dropped instead of landing on another slot's page). `PagePool` hands pages out and
takes them back; this class keeps the table in step with it and knows nothing of requests.

Shape legend: S slots, PPS pages per slot (max_model_len / page size, rounded up).
"""

from __future__ import annotations

import numpy as np

from dspine_jax.page_pool import PagePool, pages_needed


class SlotPages:
    def __init__(self, num_slots: int, num_pages: int, page_size: int, max_model_len: int):
        self.num_slots = num_slots
        self.width = pages_needed(max_model_len, page_size)
        self.pool = PagePool(num_pages, page_size)
        self.table = np.full((num_slots, self.width), num_pages, np.int32)   # [S, PPS]
        self.version = 0          # counts changes to the table (the device copy's key)
        self._held = [0] * num_slots
        self._free = list(range(num_slots))

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def free_pages(self) -> int:
        return self.pool.num_free

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return pages_needed(num_tokens, self.pool.page_size)

    def held(self, slot: int) -> int:
        return self._held[slot]

    def holds(self, slot: int, num_tokens: int) -> bool:
        """Whether `slot` holds exactly the pages for num_tokens positions already."""
        return self.pages_for(num_tokens) == self.held(slot)

    def can_fit(self, slot: int | None, num_tokens: int) -> bool:
        """Whether `slot` (None: a new one) can grow to num_tokens positions now."""
        have = 0 if slot is None else self.held(slot)
        return self.pages_for(num_tokens) - have <= self.pool.num_free

    def take(self, num_tokens: int) -> int:
        """A free slot holding pages for num_tokens positions (check can_fit first)."""
        slot = self._free.pop(0)
        self.resize(slot, num_tokens)
        return slot

    def resize(self, slot: int, num_tokens: int) -> None:
        """Hold exactly the pages for num_tokens positions: grow (OutOfPagesError if the
        pool is short) or give back whole pages past them."""
        self.pool.allocate(slot, num_tokens)
        self.pool.rollback(slot, num_tokens)
        self._write_row(slot)

    def release(self, slot: int) -> None:
        self.pool.free(slot)
        self._write_row(slot)
        self._free.append(slot)
        self._free.sort()

    def _write_row(self, slot: int) -> None:
        self.table[slot] = row = self.pool.page_table([slot], self.width)[0]
        self._held[slot] = int((row < self.pool.num_pages).sum())
        self.version += 1
