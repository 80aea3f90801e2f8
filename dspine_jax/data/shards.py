"""Token shards: the target's own responses, with loss masks, and a manifest.

A dataset folder holds `manifest.json` and `shard-NNNNN.npz` files. Each shard stores
variable-length sequences concatenated (tokens, loss_mask bool: True on response tokens)
with offsets [n + 1], compressed. Tokens are stored as uint16 where the vocabulary fits
(up to 65,536 ids: half of int32) and as uint32 above; the manifest's `token_dtype`
records which, and shards of older folders (int32, uncompressed) read as before. Shards
are written to a temporary name and renamed, and the manifest is rewritten (atomically)
after each shard, so an interrupted job resumes at the first shard it has not finished and
nothing already written is lost.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from dspine_jax.errors import CheckpointError, InputError

MANIFEST = "manifest.json"


@dataclasses.dataclass
class Sequence:
    tokens: np.ndarray     # [n] int32: prompt + response
    loss_mask: np.ndarray  # [n] bool: True on response tokens


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned type that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def write_shard(folder: Path, index: int, sequences: list[Sequence],
                dtype: str = "int32") -> str:
    name = f"shard-{index:05d}.npz"
    lengths = np.asarray([len(s.tokens) for s in sequences], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.concatenate([s.tokens for s in sequences])
    top = np.iinfo(dtype).max
    if tokens.size and (tokens.min() < 0 or tokens.max() > top):
        raise InputError(f"token ids outside [0, {top}] cannot be stored as {dtype}")
    tmp = folder / (name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, tokens=tokens.astype(dtype),
                            loss_mask=np.concatenate([s.loss_mask for s in sequences]
                                                     ).astype(bool),
                            offsets=offsets)
    os.replace(tmp, folder / name)
    return name


def read_shard(path: Path) -> list[Sequence]:
    try:
        with np.load(path) as data:
            tokens, mask, offsets = data["tokens"], data["loss_mask"], data["offsets"]
    except Exception as e:  # zipfile/ValueError/KeyError on damaged files
        raise CheckpointError(f"{path}: unreadable shard ({e})") from e
    if tokens.dtype.kind not in "iu":
        raise CheckpointError(f"{path}: tokens stored as {tokens.dtype}, not integers")
    tokens = tokens.astype(np.int32)  # uint16/uint32 on disk (int32 in older folders)
    return [Sequence(tokens[a:b], mask[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise InputError(f"{folder}: no {MANIFEST} (not a dataset folder; make one with "
                         "`dspine data regenerate`)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def write_manifest(folder: Path, manifest: dict) -> None:
    tmp = Path(folder) / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, Path(folder) / MANIFEST)


def load_dataset(folder: Path) -> list[Sequence]:
    """Every sequence of a dataset folder, in shard order."""
    manifest = read_manifest(folder)
    sequences = []
    for shard in manifest["shards"]:
        if shard["file"] is None:  # every prompt of that chunk was too long
            continue
        sequences.extend(read_shard(Path(folder) / shard["file"]))
    if not sequences:
        raise InputError(f"{folder}: the dataset has no sequences")
    return sequences
