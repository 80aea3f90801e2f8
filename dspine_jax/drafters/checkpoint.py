"""Drafter checkpoints in the layout the DFlash reference implementations read.

config.json (`architectures: ["DFlashDraftModel"]`, `block_size`, `num_hidden_layers`,
`num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids}`) plus
model.safetensors with their tensor names (`fc.weight`, `hidden_norm.weight`,
`layers.{i}.self_attn.q_proj.weight`, ...). A DSpine drafter adds its own tensors
(`injection.*`, `transfer_whiten`, `transfer_mean`) and a `dspine_config`. Token codes
follow from the target's lm_head and the whitening map, so the native checkpoint leaves
the [V, r] table out; `dspine export` adds it as `transfer_codes` (the reference layout),
and loading ignores it.

config.json's `dspine_config` holds the reference's fields (transfer_rank, message_size,
top_k); the ablation switches sit under `dspine_jax_switches`. `dspine export` writes the
reference layout (it refuses a drafter with a switch off) plus dspine_torch's modeling
files and an `auto_map`, so `AutoModel.from_pretrained(folder, trust_remote_code=True)`
builds the drafter itself.
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


# The PyTorch modules an export ships for `trust_remote_code=True` (package dspine_torch).
REMOTE_CODE = {"configuration": "configuration_dspine.py", "modeling": "modeling_dspine.py"}


def save_drafter(drafter: BlockDrafter, folder: str | Path, *, dtype=None,
                 code_table: np.ndarray | None = None, remote_code: bool = False) -> Path:
    """Write config.json + model.safetensors; `dtype` (e.g. jnp.bfloat16) casts on save.
    `code_table` [V, r] is written as `transfer_codes` for readers that want the table.
    A DSpine drafter also gets `transfer_ready` = True (its transfer space is built: a
    reference module rebuilds the space, overwriting the readouts, when it is False).
    `remote_code` copies dspine_torch's modeling files beside the weights and points
    config.json's `auto_map` at them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = drafter_tensors(drafter, dtype)
    if drafter.config.dspine is not None:
        tensors["transfer_ready"] = np.asarray(True)
    if code_table is not None:
        tensors["transfer_codes"] = np.asarray(code_table if dtype is None
                                               else jnp.asarray(code_table).astype(dtype))
    config = drafter.config.to_hf()
    if remote_code:
        config["auto_map"] = copy_remote_code(folder, drafter.config.kind)
    hf.write_safetensors(tensors, folder / "model.safetensors")  # atomic, not 0600
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def copy_remote_code(folder: Path, kind: str) -> dict[str, str]:
    """Copy dspine_torch's configuration and modeling files into `folder` (found without
    importing dspine_torch, so the JAX install needs no torch); returns the auto_map."""
    import importlib.util
    import shutil

    spec = importlib.util.find_spec("dspine_torch")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the dspine_torch package (shipped with dspine-jax) is not "
                              "installed; it holds the modeling files an export ships")
    source = Path(list(spec.submodule_search_locations)[0])
    for file in REMOTE_CODE.values():
        shutil.copyfile(source / file, folder / file)
        (folder / file).chmod(0o644)
    name = "DFlash" if kind == "dflash" else "DSpine"
    stem = {k: v.removesuffix(".py") for k, v in REMOTE_CODE.items()}
    return {"AutoConfig": f"{stem['configuration']}.{name}DraftConfig",
            "AutoModel": f"{stem['modeling']}.{name}DraftModel"}


def read_drafter_config(folder: Path) -> DrafterConfig:
    return DrafterConfig.from_hf(hf.read_config_json(folder, "a drafter checkpoint folder"))


def load_drafter(folder: str | Path, *, dtype=jnp.float32) -> BlockDrafter:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"drafter {str(folder)!r} is not a checkpoint folder")
    config = read_drafter_config(folder)
    tensors = hf.tensor_source(folder)
    if "transfer_ready" in tensors and not bool(np.asarray(tensors["transfer_ready"]())):
        raise CheckpointError(f"{folder}: transfer_ready is False: the drafter's transfer "
                              "space was never built, so its codes and readouts are unusable")
    # transfer_codes is derived (see above); transfer_ready is the reference's flag (older
    # checkpoints lack it: a saved DSpine always has its space).
    return materialise(lambda: BlockDrafter(config, dtype=dtype, rngs=nnx.Rngs(0)),
                       tensors, name_of=tensor_name, dtype=dtype, source=str(folder),
                       ignored={"transfer_codes", "transfer_ready"})
