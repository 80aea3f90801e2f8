"""`dspine train`: DFlash or DSpine drafters on the target's own responses.

Each step runs the frozen target on the batch (online features: the hidden states after
the drafter's target layers, and the target's final hidden for p_target), samples fresh
anchors per sequence, and updates the drafter with AdamW. Master weights are float32; the
drafter computes in `run.compute_dtype`. Parameters and optimizer state are stored
sharded over the mesh's fsdp axis, the batch over data x fsdp; each device computes the
drafter's loss and gradient on its rows and the gradients are summed (make_step says
why explicitly). The same code runs on one CPU, fake CPU devices, one or several GPUs
or a multi-host TPU slice (only process 0 logs and writes metrics).

Orbax keeps the last N checkpoints (parameters, optimizer state, RNG, data position);
a rerun of the same command resumes exactly where the last checkpoint left off.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspine_jax.checkpoints import load_target, resolve_dtype
from dspine_jax.data.shards import read_manifest
from dspine_jax.drafters.checkpoint import save_drafter
from dspine_jax.errors import ConfigError
from dspine_train import sharding
from dspine_train.checkpoints import Checkpoints
from dspine_train.config import TrainConfig
from dspine_train.data import BatchStream, local_rows
from dspine_train.drafter_setup import build_drafter, resolved_loss, split_drafter
from dspine_train.features import open_features
from dspine_train.flops import PEAK_FLOPS, flops_per_step
from dspine_train.metrics import SCALARS, MetricsLog, peak_device_memory
from dspine_train.optimizer import make_optimizer
from dspine_train.step import make_step
from dspine_train.stopping import StopRequest


def train(cfg: TrainConfig, *, progress: bool = True) -> dict:
    """Train (or resume) and export the drafter; returns a summary."""
    from tqdm import tqdm

    out = Path(cfg.run.out)
    lead = jax.process_index() == 0
    if lead:
        out.mkdir(parents=True, exist_ok=True)
    if cfg.run.batch_size % jax.process_count():
        raise ConfigError(f"run.batch_size {cfg.run.batch_size} must be a multiple of the "
                          f"{jax.process_count()} processes")
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
    if cfg.run.batch_size % (mesh.shape["data"] * mesh.shape["fsdp"]):
        raise ConfigError(f"run.batch_size {cfg.run.batch_size} must divide evenly over the "
                          f"{mesh.devices.size} devices")
    compute_dtype = resolve_dtype(cfg.run.compute_dtype)

    loaded = load_target(cfg.target.name, dtype=cfg.target.dtype)
    manifest = read_manifest(Path(cfg.data.path))
    drafter = build_drafter(cfg, loaded)
    dc = drafter.config
    if cfg.data.seq_len > loaded.config.max_position_embeddings:
        raise ConfigError(f"data.seq_len {cfg.data.seq_len} exceeds the target's context "
                          f"{loaded.config.max_position_embeddings}")
    losses = resolved_loss(cfg, dc)
    stream = BatchStream(Path(cfg.data.path), cfg.data.seq_len, cfg.run.batch_size,
                         cfg.run.seed)

    target_graph, target_params = nnx.split(loaded.model)
    drafter_graph, params, rest = split_drafter(drafter)
    tx, schedule = make_optimizer(cfg)
    opt_state = tx.init(params)
    target_params = sharding.shard_tree(target_params, mesh)
    rest = sharding.shard_tree(rest, mesh)
    state = {"params": sharding.shard_tree(params, mesh),
             "opt_state": sharding.shard_tree(opt_state, mesh),
             "rng": jax.random.key_data(jax.random.key(cfg.run.seed))}
    step = 0
    checkpoints = Checkpoints(out / "checkpoints", cfg.run.keep_checkpoints)
    latest = checkpoints.latest()
    if latest is not None:
        state, meta = checkpoints.restore(latest, state)
        if meta["config"] != _resumable(cfg):
            raise ConfigError(f"{out} holds a run with another configuration; resume with "
                              "the same config or choose another run.out")
        step = int(meta["step"])
        stream.seek(meta["data_position"])
        state = {"params": sharding.shard_tree(state["params"], mesh),
                 "opt_state": sharding.shard_tree(state["opt_state"], mesh), "rng": state["rng"]}
    if lead:
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))

    step_fn = jax.jit(make_step(cfg, target_graph, drafter_graph, tx, losses, dc,
                                compute_dtype, mesh), donate_argnums=(2, 3))
    log = MetricsLog(out / "metrics.csv", dc.block_size, lead)
    flops = flops_per_step(loaded.config, drafter, cfg.run.batch_size, cfg.data.seq_len,
                           cfg.data.blocks_per_seq)
    params, opt_state = state["params"], state["opt_state"]
    # Committed to the mesh like the key the step returns, so step 2 reuses step 1's program.
    rng = sharding.shard_tree(jax.random.wrap_key_data(state["rng"]), mesh)
    stop_at = min(cfg.run.steps, step + cfg.run.stop_after) if cfg.run.stop_after else cfg.run.steps
    bar = tqdm(total=cfg.run.steps, initial=step, disable=not (progress and lead), unit="step",
               desc=f"train {dc.kind}")
    window_start, window_steps, last, timing = time.perf_counter(), 0, {}, False
    cached = open_features(cfg, dc, len(stream.tokens)) if cfg.data.cached_features else None
    stopping = StopRequest(cfg.run.max_seconds)
    try:
        while step < stop_at:
            tokens, mask, rows = stream.next()
            batch = [sharding.global_batch(local_rows(tokens), mesh),
                     sharding.global_batch(local_rows(mask), mesh)]
            if cached is not None:
                mine = local_rows(rows)
                order = np.argsort(mine)  # memory-mapped reads in file order
                back = np.argsort(order)
                batch += [sharding.global_batch(np.asarray(a[mine[order]])[back], mesh)
                          for a in cached]
            params, opt_state, step_arr, rng, metrics = step_fn(
                target_params, rest, params, opt_state, jnp.asarray(step, jnp.int32), rng,
                *batch)
            step += 1
            window_steps += 1
            bar.update(1)
            if step < stop_at and stopping.now(step, cfg.run.log_every):
                stop_at = step  # checkpoint below, then leave: a rerun resumes from here
            if not timing:  # the first step compiled: time from here on
                jax.block_until_ready(params)
                window_start, window_steps, timing = time.perf_counter(), 0, True
            if (step % cfg.run.log_every == 0 or step == stop_at) and window_steps:
                metrics = jax.device_get(metrics)
                elapsed = time.perf_counter() - window_start
                row = {"step": step, "lr": float(schedule(step - 1))}
                for key in SCALARS:
                    if key in metrics:
                        row[key] = float(metrics[key])
                for s, acc in enumerate(np.asarray(metrics["slot_accuracy"])[1:], 1):
                    row[f"slot_acc_{s}"] = float(acc)
                row["tokens_per_s"] = (window_steps * cfg.run.batch_size * cfg.data.seq_len
                                       / elapsed)
                peak = PEAK_FLOPS.get(jax.devices()[0].platform)
                if peak:
                    row["mfu"] = window_steps * flops / elapsed / peak / jax.device_count()
                log.write(row)
                bar.set_postfix(loss=f"{row['loss']:.3f}", tau=f"{row['accept_len_blocks']:.2f}")
                last = row
                window_start, window_steps = time.perf_counter(), 0
            if step % cfg.run.checkpoint_every == 0 or step == stop_at:
                checkpoints.save(step, {"params": params, "opt_state": opt_state,
                                        "rng": jax.random.key_data(rng)},
                                 {"step": step, "data_position": stream.position,
                                  "config": _resumable(cfg)})
        bar.close()
    finally:  # an exception must not leave our SIGTERM handler installed
        stopping.release()
    checkpoints.wait()
    finished = step >= cfg.run.steps
    summary = {"steps": step, "finished": finished, "out": str(out),
               "truncated_sequences": stream.truncated, "last": last,
               "data_manifest": manifest.get("settings", {}),
               "peak_device_memory_bytes": peak_device_memory()}
    # Every process takes part in gathering fsdp shards from other hosts; process 0 writes.
    final = (nnx.merge(drafter_graph, sharding.to_host(params), sharding.to_host(rest))
             if finished else None)
    if finished and lead:
        save_drafter(final, out / "drafter")
        summary["drafter"] = str(out / "drafter")
        log.plot(out / "metrics.png")
    if lead:
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _resumable(cfg: TrainConfig) -> dict:
    """The config a resumed run must match (stop_after/max_seconds only say when to stop)."""
    d = cfg.to_dict()
    d["run"] = {k: v for k, v in d["run"].items() if k not in ("stop_after", "max_seconds")}
    return d
