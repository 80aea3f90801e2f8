"""AdamW with warm-up and cosine decay, after global-norm clipping (the paper's recipe)."""

from __future__ import annotations

import optax

from dspine_train.config import TrainConfig


def make_optimizer(cfg: TrainConfig):
    """AdamW with linear warm-up then cosine decay to 0, after global-norm clipping."""
    o = cfg.optim
    warmup = max(1, int(o.warmup_ratio * cfg.run.steps))
    schedule = optax.warmup_cosine_decay_schedule(0.0, o.lr, warmup, max(cfg.run.steps, warmup + 1))
    tx = optax.chain(optax.clip_by_global_norm(o.clip),
                     optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))
    return tx, schedule
