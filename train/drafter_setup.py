"""The drafter a training config describes: its architecture, fresh weights or a
checkpoint to start from, the float32 master-weight split, and the resolved loss."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from dspine_jax.drafters.checkpoint import load_drafter, read_drafter_config
from dspine_jax.drafters.config import DrafterConfig, mask_token_for
from dspine_jax.drafters.model import BlockDrafter
from dspine_jax.losses import LossConfig
from dspine_jax.registry import resolve_drafter
from dspine_train.config import TrainConfig


def is_run_folder(path: str | Path) -> bool:
    """A `dspine train` run folder (its checkpoints/), as opposed to an exported drafter."""
    return bool(path) and (Path(path) / "checkpoints").is_dir()


def drafter_config(cfg: TrainConfig, target) -> DrafterConfig:
    """The drafter a config describes (read from init_from when it names an exported
    drafter, a folder or a built-in name; a run folder's weights must fit the config's own
    architecture)."""
    d = cfg.drafter
    if d.init_from and not is_run_folder(d.init_from):
        config = read_drafter_config(resolve_drafter(d.init_from))
        config.check_target(target.config)
        return config
    spine = cfg.dspine
    if d.kind == "dspine" and spine is None:
        spine = DrafterConfig.default_dspine(target.config.hidden_size)
    mask = d.mask_token_id if d.mask_token_id >= 0 else mask_token_for(target.tokenizer)
    return DrafterConfig.for_target(target.config, kind=d.kind, num_layers=d.layers,
                                    mask_token_id=mask, block_size=d.block_size, dspine=spine)


def build_drafter(cfg: TrainConfig, target) -> BlockDrafter:
    """The drafter to train: an exported drafter's weights, or fresh (a run folder's
    weights are restored into it by the trainer)."""
    if cfg.drafter.init_from and not is_run_folder(cfg.drafter.init_from):
        drafter = load_drafter(resolve_drafter(cfg.drafter.init_from), dtype=jnp.float32)
        drafter.config.check_target(target.config)
        return drafter
    return BlockDrafter.create(drafter_config(cfg, target), target.model.output_embedding(),
                               seed=cfg.run.seed)


def split_drafter(drafter: BlockDrafter):
    """(graph, trainable params as float32 master weights, the rest: DSpine's fixed
    transfer basis, kept as it is)."""
    graph, params, rest = nnx.split(drafter, nnx.Param, ...)
    return graph, jax.tree.map(lambda x: x.astype(jnp.float32), params), rest


def resolved_loss(cfg: TrainConfig, drafter: DrafterConfig) -> LossConfig:
    """The config's `[loss]`, filled in for this drafter."""
    return cfg.loss.resolve(drafter)
