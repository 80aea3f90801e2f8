"""DSpine's unified transfer space, built once from the target's frozen lm_head.

Token v's code is its whitened, unit-length lm_head direction in the top-r principal
subspace of the (L2-normalised) rows. Only the whitening map [H, r] is stored: codes are
computed from lm_head rows when needed (a [V, r] table would be 300 MB for Qwen3's
vocabulary). Hidden states are read into the same space by per-layer readouts
initialised to the same projection, so a hidden state and the token it predicts can be
compared (and written into a successor) in one r-dim space.

Shape legend: V vocab, H hidden, r transfer rank.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dspine_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TransferSpace:
    whiten: np.ndarray       # [H, r] projection onto the top-r directions, then whitening
    mean: np.ndarray         # [H] mean normalised lm_head row
    projection: np.ndarray   # [r, H] D^T: the readouts' initial weight
    eigenvalues: np.ndarray  # [r] descending

    def codes(self, output_embedding) -> np.ndarray:
        return code_table(output_embedding, self.mean, self.whiten)


def unit_rows(rows):
    return rows / jnp.maximum(jnp.linalg.norm(rows, axis=-1, keepdims=True), 1e-12)


def transfer_codes(rows, mean, whiten):
    """lm_head rows [..., H] -> their codes c [..., r] float32 (unit length)."""
    centred = unit_rows(jnp.asarray(rows, jnp.float32)) - jnp.asarray(mean, jnp.float32)
    return unit_rows(centred @ jnp.asarray(whiten, jnp.float32))


def code_table(output_embedding, mean, whiten, *, chunk: int = 8192) -> np.ndarray:
    """All V codes [V, r] float32 (for export, inspection and tests; the drafter computes
    only the rows it needs)."""
    e_out = jnp.asarray(output_embedding, jnp.float32)
    return np.concatenate([np.asarray(transfer_codes(e_out[s:s + chunk], mean, whiten))
                           for s in range(0, e_out.shape[0], chunk)])


def build_transfer_space(output_embedding, rank: int, *, chunk: int = 8192) -> TransferSpace:
    """output_embedding E_out [V, H] -> whitening map and projection. Covariance
    accumulates in float32 over row chunks (bounded memory for 150k vocabularies); the
    eigensolve is float64 on the host (H x H)."""
    e_out = jnp.asarray(output_embedding, jnp.float32)
    vocab, hidden = e_out.shape
    if rank > hidden:
        raise ConfigError(f"transfer rank {rank} exceeds the hidden size {hidden}")

    starts = range(0, vocab, chunk)
    mean = sum(jnp.sum(unit_rows(e_out[s:s + chunk]), axis=0) for s in starts) / vocab
    second = sum(_gram(unit_rows(e_out[s:s + chunk]) - mean) for s in starts)
    cov = np.asarray(second, np.float64) / vocab
    eigenvalues, eigenvectors = np.linalg.eigh(cov)  # ascending
    order = np.argsort(eigenvalues)[::-1][:rank]
    eigenvalues, d = eigenvalues[order], eigenvectors[:, order]  # d: [H, r]
    positive = int(np.sum(eigenvalues > 1e-10 * max(eigenvalues[0], 1e-30)))
    if positive < rank:
        raise ConfigError(f"the lm_head rows span only {positive} directions; transfer rank "
                          f"{rank} needs {rank} positive eigenvalues. Lower transfer_rank.")

    # [H, r]: projection then whitening, folded into one matrix.
    whiten = (d / np.sqrt(eigenvalues)[None, :]).astype(np.float32)
    return TransferSpace(whiten=whiten, mean=np.asarray(mean, np.float32),
                         projection=d.T.astype(np.float32), eigenvalues=eigenvalues)


@jax.jit
def _gram(x):
    return x.T @ x
