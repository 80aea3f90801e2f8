"""Drafter checkpoints in the layout the DFlash reference implementations read.

config.json (`architectures: ["DFlashDraftModel"]`, `block_size`, `num_hidden_layers`,
`num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids}`) plus
model.safetensors with their tensor names (`fc.weight`, `hidden_norm.weight`,
`layers.{i}.self_attn.q_proj.weight`, ...). A DSpine drafter adds its own tensors
(`injection.*`, `transfer_whiten`, `transfer_mean`) and a `dspine_config`. Token codes
follow from the target's lm_head and the whitening map, so the native checkpoint leaves
the [V, r] table out; `dspine export` adds it as `transfer_codes` (the reference layout),
and loading ignores it.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspine_jax.checkpoints import hf
from dspine_jax.checkpoints.params import materialise
from dspine_jax.drafters.config import DrafterConfig
from dspine_jax.drafters.model import BlockDrafter
from dspine_jax.errors import CheckpointError


def tensor_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def drafter_tensors(drafter: BlockDrafter, dtype=None) -> dict[str, np.ndarray]:
    """Every variable by name; `dtype` casts the trained weights (nnx.Param) only, the
    fixed transfer basis stays float32."""
    flat = nnx.to_flat_state(nnx.state(drafter))
    out = {}
    for path, var in flat:
        value = var[...]
        cast = dtype is not None and isinstance(var, nnx.Param)
        out[tensor_name(path)] = np.asarray(value.astype(dtype) if cast else value)
    return out


def save_drafter(drafter: BlockDrafter, folder: str | Path, *, dtype=None,
                 code_table: np.ndarray | None = None) -> Path:
    """Write config.json + model.safetensors; `dtype` (e.g. jnp.bfloat16) casts on save.
    `code_table` [V, r] is written as `transfer_codes` for readers that want the table."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = drafter_tensors(drafter, dtype)
    if code_table is not None:
        tensors["transfer_codes"] = np.asarray(code_table if dtype is None
                                               else jnp.asarray(code_table).astype(dtype))
    hf.write_safetensors(tensors, folder / "model.safetensors")  # atomic, not 0600
    (folder / "config.json").write_text(json.dumps(drafter.config.to_hf(), indent=2))
    return folder


def read_drafter_config(folder: Path) -> DrafterConfig:
    return DrafterConfig.from_hf(hf.read_config_json(folder, "a drafter checkpoint folder"))


def load_drafter(folder: str | Path, *, dtype=jnp.float32) -> BlockDrafter:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"drafter {str(folder)!r} is not a checkpoint folder")
    config = read_drafter_config(folder)
    return materialise(lambda: BlockDrafter(config, dtype=dtype, rngs=nnx.Rngs(0)),
                       hf.tensor_source(folder), name_of=tensor_name, dtype=dtype,
                       source=str(folder), ignored={"transfer_codes"})  # derived, see above
