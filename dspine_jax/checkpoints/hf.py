"""HF checkpoint folders: config.json plus single or sharded safetensors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from dspine_jax.checkpoints.params import TensorSource
from dspine_jax.config import TargetConfig
from dspine_jax.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_config_json(folder: Path, kind: str = "an HF checkpoint folder") -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json (not {kind})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def read_config(folder: Path) -> TargetConfig:
    return TargetConfig.from_hf(read_config_json(folder))


def tensor_source(folder: Path) -> TensorSource:
    """name -> loader over every safetensors file of the folder, via the index if sharded."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable shard index ({e})") from e
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise CheckpointError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}")

    loaders = {}
    for file in files:
        path = folder / file
        if not path.is_file():
            raise CheckpointError(f"{folder}: shard {file} named in the index is missing")
        try:
            with safe_open(str(path), framework="numpy") as f:
                names = list(f.keys())
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise CheckpointError(f"{path}: corrupt safetensors file ({e})") from e
        for name in names:
            loaders[name] = _loader(path, name)
    return loaders


def _loader(path: Path, name: str):
    def load() -> np.ndarray:
        try:
            with safe_open(str(path), framework="numpy") as f:
                return f.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor {name} ({e})") from e
    return load


def save_folder(folder: Path, config: TargetConfig, tensors: dict[str, np.ndarray]) -> None:
    """Write config.json and model.safetensors that transformers loads as the same model."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
    write_safetensors(tensors, folder / SINGLE_FILE)


def write_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """Write through a temporary file (no half-written file is left behind), then give it
    the permissions of any file the user creates. safetensors writes via its own temp
    file, which comes out 0600: unreadable to the group that reads exported checkpoints."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    # (np.ascontiguousarray would turn a 0-d flag such as transfer_ready into shape (1,).)
    save_file({k: np.asarray(v) if np.ndim(v) == 0 else np.ascontiguousarray(v)
               for k, v in tensors.items()}, str(tmp),
              metadata={"format": "pt"})
    os.chmod(tmp, 0o666 & ~_umask())
    tmp.replace(path)


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it; put it straight back
    os.umask(mask)
    return mask
