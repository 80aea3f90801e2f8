"""Cached target features: the target's outputs for a dataset, computed once.

Online features (the default) run the frozen target inside every training step. For a
large target trained for many epochs it is cheaper to run it once: `dspine data features`
stores, for every training sequence in the trainer's order, the hidden states after the
drafter's target layers and the final hidden (for p_target), as float16 memory-mapped
arrays next to the dataset. `data.cached_features = true` makes the trainer read them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from dspine_jax.errors import InputError


def features_folder(cfg, drafter_config) -> Path:
    key = json.dumps([cfg.target.name, list(drafter_config.target_layer_ids), cfg.data.seq_len])
    return Path(cfg.data.path) / f"features-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def open_features(cfg, drafter_config, num_rows: int):
    folder = features_folder(cfg, drafter_config)
    if not (folder / "meta.json").is_file():
        raise InputError(f"data.cached_features is on but {folder} does not exist; run "
                         "`dspine data features` with the same config first")
    arrays = [np.load(folder / name, mmap_mode="r") for name in ("features.npy", "final.npy")]
    if arrays[0].shape[0] != num_rows:
        raise InputError(f"{folder} holds {arrays[0].shape[0]} sequences, the dataset "
                         f"{num_rows}: recompute the features")
    return arrays


def cache_features(cfg, batch_size: int = 16) -> Path:
    from dspine_jax.checkpoints import load_target
    from dspine_train.data import BatchStream
    from dspine_train.drafter_setup import drafter_config

    loaded = load_target(cfg.target.name, dtype=cfg.target.dtype)
    dc = drafter_config(cfg, loaded)  # only the layer ids: no transfer space to build
    stream = BatchStream(Path(cfg.data.path), cfg.data.seq_len, 1, cfg.run.seed)
    folder = features_folder(cfg, dc)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    n, t, h = len(stream.tokens), cfg.data.seq_len, loaded.config.hidden_size
    feats = np.lib.format.open_memmap(tmp / "features.npy", "w+", np.float16,
                                      (n, t, dc.num_features * h))
    final = np.lib.format.open_memmap(tmp / "final.npy", "w+", np.float16, (n, t, h))
    graph, params = nnx.split(loaded.model)

    @jax.jit
    def run(tokens):
        out = nnx.merge(graph, params)(tokens, hidden_layer_ids=dc.target_layer_ids,
                                       return_logits=False)
        return out.features(), out.final_hidden

    for start in tqdm(range(0, n, batch_size), desc="features", unit="batch"):
        rows = stream.tokens[start:start + batch_size].astype(np.int32)
        pad = batch_size - len(rows)  # keep one compiled shape
        f, z = run(jnp.asarray(np.pad(rows, ((0, pad), (0, 0)))))
        feats[start:start + len(rows)] = np.asarray(f[:len(rows)], np.float16)
        final[start:start + len(rows)] = np.asarray(z[:len(rows)], np.float16)
    feats.flush()
    final.flush()
    (tmp / "meta.json").write_text(json.dumps({
        "target": cfg.target.name, "target_layer_ids": list(dc.target_layer_ids),
        "seq_len": t, "sequences": n}))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder
