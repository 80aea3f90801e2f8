"""Drafter checkpoints in the layout the DFlash/DSpine reference implementations read.

config.json (`architectures: ["DFlashDraftModel"]`, `block_size`, `num_hidden_layers`,
`num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids}`) plus
model.safetensors with their tensor names (`fc.weight`, `hidden_norm.weight`,
`layers.{i}.self_attn.q_proj.weight`, ...). A DSpine drafter adds its own tensors
(`injection.*`, `transfer_ready`) and a `dspine_config`, and holds its transfer space in
one of two layouts:
  * native (what training writes): the whitening map `transfer_whiten` [H, r] and
    `transfer_mean` [H]; token codes follow from the target's lm_head;
  * reference (what `dspine export` writes, and SpecForge's `DSpineDraftModel` holds):
    the code table `transfer_codes` [V, r], float32, and no map. Folding the map into the
    table is exact: the map is used only through the codes of token ids.
`load_drafter` reads both (old exports carried the map and the table: the map is used).

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
from dspine_jax.target import unfused_tensors


def tensor_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def drafter_tensors(drafter: BlockDrafter, dtype=None) -> dict[str, np.ndarray]:
    """Every variable by name; `dtype` casts the trained weights (nnx.Param) only, the
    fixed transfer basis stays float32."""
    flat = nnx.to_flat_state(nnx.state(drafter))
    out = {}
    for path, var in flat:
        if path[0] == "context_kv_proj":     # a fused drafter's copy of the layers' k/v
            continue
        value = var[...]
        cast = dtype is not None and isinstance(var, nnx.Param)
        out[tensor_name(path)] = np.asarray(value.astype(dtype) if cast else value)
    return unfused_tensors(out, drafter.config.layer_config())


# The PyTorch modules an export ships for `trust_remote_code=True` (package dspine_torch).
REMOTE_CODE = {"configuration": "configuration_dspine.py", "modeling": "modeling_dspine.py"}


# The whitening map of the native layout; the reference layout has the code table instead.
MAP_TENSORS = ("transfer_whiten", "transfer_mean")


def save_drafter(drafter: BlockDrafter, folder: str | Path, *, dtype=None,
                 code_table: np.ndarray | None = None, remote_code: bool = False) -> Path:
    """Write config.json + model.safetensors; `dtype` (e.g. jnp.bfloat16) casts the trained
    weights on save. `code_table` [V, r] (`BlockDrafter.code_table` over the target's
    lm_head) writes a DSpine drafter in the reference layout: the table as
    `transfer_codes` (float32) in place of the whitening map. A DSpine drafter also gets
    `transfer_ready` = True (its transfer space is built: a reference module rebuilds the
    space, overwriting the readouts, when it is False). `remote_code` copies dspine_torch's
    modeling files beside the weights and points config.json's `auto_map` at them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = drafter_tensors(drafter, dtype)
    spine = drafter.config.dspine
    if spine is not None:
        tensors["transfer_ready"] = np.asarray(True)
    if code_table is not None:
        expected = (drafter.config.vocab_size, spine.transfer_rank) if spine else None
        if expected is None or tuple(np.shape(code_table)) != expected:
            raise ValueError(f"a code table [V, r] = {expected} is for a DSpine drafter; "
                             f"got shape {np.shape(code_table)}")
        for name in MAP_TENSORS:
            tensors.pop(name, None)
        tensors["transfer_codes"] = np.asarray(code_table, np.float32)
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
    """The drafter a checkpoint folder holds, in either layout (see the module docstring),
    every tensor checked against the config."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"drafter {str(folder)!r} is not a checkpoint folder")
    config = read_drafter_config(folder)
    tensors = hf.tensor_source(folder)
    ignored, table = set(), False
    if config.dspine is not None:
        if "transfer_ready" in tensors and not bool(np.asarray(tensors["transfer_ready"]())):
            raise CheckpointError(f"{folder}: transfer_ready is False: the drafter's transfer "
                                  "space was never built, so its codes and readouts are unusable")
        # transfer_ready is the reference's flag (older checkpoints lack it: a saved DSpine
        # always has its space).
        ignored.add("transfer_ready")
        if set(MAP_TENSORS) <= set(tensors):
            ignored.add("transfer_codes")  # older exports carried both: the map defines it
        elif "transfer_codes" in tensors:
            table = True
        else:
            raise CheckpointError(f"{folder}: a DSpine checkpoint needs its transfer space: "
                                  "transfer_whiten and transfer_mean, or transfer_codes")
    return materialise(
        lambda: BlockDrafter(config, dtype=dtype, rngs=nnx.Rngs(0), code_table=table),
        tensors, name_of=tensor_name, dtype=dtype, source=str(folder), ignored=ignored)
