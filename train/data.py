"""The training batches: padded token rows in a deterministic, resumable order."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from dspine_jax.data.shards import load_dataset
from dspine_jax.errors import InputError


class BatchStream:
    """Deterministic, resumable batches: epoch e visits the sequences in a permutation
    seeded by (seed, e); `position` = (epoch, index) is saved with each checkpoint."""

    def __init__(self, folder: Path, seq_len: int, batch_size: int, seed: int):
        sequences = load_dataset(folder)
        self.truncated = sum(len(s.tokens) > seq_len for s in sequences)
        usable = [s for s in sequences if s.loss_mask[1:seq_len].any()]
        if len(usable) < batch_size:
            raise InputError(f"{folder}: {len(usable)} usable sequences, fewer than the batch "
                             f"size {batch_size}")
        # Stored as compactly as the shards (uint16 for vocabularies up to 65,536), cast
        # per batch: ten times the data stays a few GB at seq_len 1,536.
        top = max((int(s.tokens.max()) for s in usable if len(s.tokens)), default=0)
        self.tokens = np.zeros((len(usable), seq_len), np.uint16 if top < 1 << 16 else np.int32)
        self.mask = np.zeros((len(usable), seq_len), bool)
        for i, s in enumerate(usable):
            n = min(len(s.tokens), seq_len)
            self.tokens[i, :n] = s.tokens[:n]
            self.mask[i, :n] = s.loss_mask[:n]
        self.batch_size, self.seed = batch_size, seed
        self.epoch, self.index = 0, 0

    @property
    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def seek(self, position: dict) -> None:
        self.epoch, self.index = position["epoch"], position["index"]

    def next(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, loss_mask, row indices) of the next global batch."""
        if self.index + self.batch_size > len(self.tokens):
            self.epoch, self.index = self.epoch + 1, 0
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.tokens))
        rows = order[self.index:self.index + self.batch_size]
        self.index += self.batch_size
        return self.tokens[rows].astype(np.int32), self.mask[rows], rows


def local_rows(array: np.ndarray) -> np.ndarray:
    """This process's share of a global batch."""
    per = len(array) // jax.process_count()
    return array[jax.process_index() * per:(jax.process_index() + 1) * per]
