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

A long run is a chain of short ones. `run.resume_from` continues another run folder's
latest checkpoint in a new run.out (everything: the result equals one uninterrupted run);
the step counter is global, so the learning-rate schedule and the teacher-replacement
curriculum, both laid over run.steps (the chain's total), carry on where the last link
stopped. `drafter.init_from` with a run folder (or an exported drafter) takes its weights
alone: step 0, a fresh AdamW (its moments are re-estimated from zero) and a new warm-up
and curriculum over this run's run.steps. Each folder's chain.json says how it started;
`python -m dspine_train.chain` joins the links' metrics into one curve.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspine_jax.attention.backend import AttentionBackend, CudnnBackend, XlaBackend
from dspine_jax.checkpoints import load_target, resolve_dtype
from dspine_jax.data.shards import read_manifest
from dspine_jax.drafters.checkpoint import save_drafter
from dspine_jax.errors import ConfigError
from dspine_jax.registry import resolve_drafter
from dspine_train import sharding
from dspine_train.checkpoints import Checkpoints
from dspine_train.config import TrainConfig
from dspine_train.data import BatchStream, local_rows
from dspine_train.drafter_setup import (build_drafter, is_run_folder, resolved_loss,
                                        split_drafter)
from dspine_train.features import open_features
from dspine_train.flops import PEAK_FLOPS, flops_per_step
from dspine_train.metrics import SCALARS, MetricsLog, peak_device_memory
from dspine_train.optimizer import make_optimizer
from dspine_train.step import make_step
from dspine_train.stopping import StopRequest


def train(cfg: TrainConfig, *, progress: bool = True, trace_dir: Path | None = None,
          trace_steps: int = 0, analysis: dict | None = None) -> dict:
    """Train (or resume) and export the drafter; returns a summary.

    trace_dir: a jax.profiler trace of `trace_steps` steps after the compiling first one
    (a trace that also covers the compilation holds almost none of the steps' kernels).
    analysis: a dict to fill with XLA's account of the compiled step (`step_analysis`:
    FLOPs, bytes accessed, temporary memory)."""
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
    # before the target loads
    target_attention = training_attention(cfg.target.attention, resolve_dtype(cfg.target.dtype),
                                          "target.attention")
    drafter_attention = training_attention(cfg.drafter.attention, compute_dtype,
                                           "drafter.attention")
    if cfg.drafter.init_from and not is_run_folder(cfg.drafter.init_from):
        resolve_drafter(cfg.drafter.init_from)    # a name or folder that exists, or an error

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
    checkpoints = Checkpoints(out / "checkpoints", cfg.run.keep_checkpoints)
    architecture = json.loads(json.dumps(dc.to_hf()))  # as the checkpoint's JSON holds it
    step, origin = 0, {"start": "scratch"}
    latest = checkpoints.latest()
    if latest is not None:  # this run's own checkpoint comes first: a rerun resumes itself
        state, meta = _restore(checkpoints, latest, state, architecture, out, lambda meta: _same(
            {k: v for k, v in meta["config"].items() if k != "mesh"}, _resumable(cfg),
            f"{out} holds a run with another configuration",
            "resume with the same config or choose another run.out"))
        if (out / "chain.json").is_file():  # how this folder first started
            origin = json.loads((out / "chain.json").read_text())
    elif cfg.run.resume_from:  # the next link of a chain: continue another run folder
        source = Path(cfg.run.resume_from)
        state, meta = _restore(_source(source, "run.resume_from"), None, state, architecture,
                               source, lambda meta: _same(
            _chain_key(meta["config"]), _chain_key(_resumable(cfg)),
            f"run.resume_from {source} was trained with another configuration",
            "a chain's links may change only run.out, run.steps, run.stop_after, "
            "run.max_seconds, run.log_every, run.checkpoint_every, run.keep_checkpoints, "
            "mesh.*, the attention kernels, loss.logits and drafter.init_from; start from its "
            "weights alone with --init-from instead"))
        origin = {"start": "resume", "source": str(source)}
    elif is_run_folder(cfg.drafter.init_from):  # weights alone: fresh optimizer and step 0
        source = Path(cfg.drafter.init_from)
        restored, meta = _restore(_source(source, "drafter.init_from"), None, state,
                                  architecture, source)
        state, meta = {**state, "params": restored["params"]}, None
        origin = {"start": "weights", "source": str(source)}
    else:
        meta = None
        if cfg.drafter.init_from:
            origin = {"start": "weights", "source": cfg.drafter.init_from}
    if meta is not None:
        step = int(meta["step"])
        stream.seek(meta["data_position"])
    state = {"params": sharding.shard_tree(state["params"], mesh),
             "opt_state": sharding.shard_tree(state["opt_state"], mesh), "rng": state["rng"]}
    if lead:
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        if latest is None:  # how this folder started, for `dspine_train.chain`
            (out / "chain.json").write_text(json.dumps({**origin, "start_step": step}))

    step_fn = jax.jit(make_step(cfg, target_graph, drafter_graph, tx, losses, dc,
                                compute_dtype, mesh, target_attention=target_attention,
                                drafter_attention=drafter_attention),
                      donate_argnums=(2, 3))
    log = MetricsLog(out / "metrics.csv", dc.block_size, lead)
    flops = flops_per_step(loaded.config, drafter, cfg.run.batch_size, cfg.data.seq_len,
                           cfg.data.blocks_per_seq, losses)
    params, opt_state = state["params"], state["opt_state"]
    # Committed to the mesh like the key the step returns, so step 2 reuses step 1's program.
    rng = sharding.shard_tree(jax.random.wrap_key_data(state["rng"]), mesh)
    stop_at = min(cfg.run.steps, step + cfg.run.stop_after) if cfg.run.stop_after else cfg.run.steps
    bar = tqdm(total=cfg.run.steps, initial=step, disable=not (progress and lead), unit="step",
               desc=f"train {dc.kind}")
    window_start, window_steps, last, timing = time.perf_counter(), 0, {}, False
    tracing = False
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
            args = (target_params, rest, params, opt_state, jnp.asarray(step, jnp.int32), rng,
                    *batch)
            if analysis is not None and not analysis:
                analysis.update(step_analysis(step_fn, args))
            params, opt_state, step_arr, rng, metrics = step_fn(*args)
            step += 1
            window_steps += 1
            bar.update(1)
            if step < stop_at and stopping.now(step, cfg.run.log_every):
                stop_at = step  # checkpoint below, then leave: a rerun resumes from here
            if not timing:  # the first step compiled: time from here on
                jax.block_until_ready(params)
                window_start, window_steps, timing = time.perf_counter(), 0, True
                if trace_dir is not None:
                    jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
                    tracing, trace_until = True, step + trace_steps
            elif tracing and step == trace_until:
                jax.block_until_ready(params)
                jax.profiler.stop_trace()
                tracing = False
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
                                  "config": _resumable(cfg), "drafter": architecture})
        bar.close()
    finally:  # an exception must not leave our SIGTERM handler installed (nor a trace open)
        stopping.release()
        if tracing:
            jax.profiler.stop_trace()
    checkpoints.wait()
    finished = step >= cfg.run.steps
    summary = {"steps": step, "finished": finished, "out": str(out), "origin": origin,
               "truncated_sequences": stream.truncated, "last": last,
               "data_manifest": manifest.get("settings", {}),
               "peak_device_memory_bytes": peak_device_memory()}
    # Every process takes part in gathering fsdp shards from other hosts; process 0 writes.
    final = nnx.merge(drafter_graph, *sharding.to_host((params, rest))) if finished else None
    if finished and lead:
        save_drafter(final, out / "drafter")
        summary["drafter"] = str(out / "drafter")
        log.plot(out / "metrics.png")
    if lead:
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def step_analysis(step_fn, args) -> dict:
    """XLA's account of the compiled step for these arguments (compiled once more, not
    run): matmul and elementwise FLOPs, bytes its operations read and write after fusion
    (an estimate of the memory traffic), and the temporary buffers it needs at its peak."""
    compiled = step_fn.lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    memory = compiled.memory_analysis()
    return {"flops": float(cost.get("flops", 0.0)),
            "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "temp_bytes": int(getattr(memory, "temp_size_in_bytes", 0))}


def training_attention(choice: str, dtype, key: str) -> AttentionBackend:
    """The attention backend of a training forward (`target.attention` for the frozen
    target, `drafter.attention` for the drafter, computing in `dtype`): "auto" is cuDNN's
    fused attention where it runs (a CUDA GPU, bf16/f16; XLA's attention writes the
    [B, N, T, S] float32 scores of every layer, and on an H100 the drafter's took 40% of
    a SmolLM2 step) and XLA elsewhere; "cudnn" where it cannot run is an error naming the
    problem."""
    if choice == "xla":
        return XlaBackend()
    backend = CudnnBackend()
    reason = backend.check(head_dim=0, num_heads=0, num_kv_heads=0, dtype=dtype)
    if reason is not None and choice == "auto":
        return XlaBackend()
    if reason is not None:
        raise ConfigError(f"{key} = 'cudnn' does not run on {reason}; use {key} = 'xla'")
    return backend


def _resumable(cfg: TrainConfig) -> dict:
    """The config a resumed run must match: stop_after/max_seconds only say when to stop,
    and the mesh and the attention kernels only where and how the same arithmetic
    runs (a run may move from one GPU to two)."""
    d = cfg.to_dict()
    d["run"] = {k: v for k, v in d["run"].items() if k not in ("stop_after", "max_seconds")}
    for section in ("target", "drafter"):
        d[section] = {k: v for k, v in d[section].items() if k != "attention"}
    d.pop("mesh")
    return d


# What the next link of a chain may change: where it writes and when it stops; run.steps
# too (extending a chain: the schedule is laid over the new total from the current step);
# and how the same math runs (the attention kernels, the loss's vocabulary path).
CHAIN_FREE = {"run": ("out", "steps", "log_every", "checkpoint_every", "keep_checkpoints",
                      "resume_from"), "drafter": ("init_from", "attention"),
              "target": ("attention",), "loss": ("logits",)}


def _chain_key(config: dict) -> dict:
    d = {name: dict(table) if isinstance(table, dict) else table
         for name, table in config.items() if name != "mesh"}
    for name, keys in CHAIN_FREE.items():
        for key in keys:
            d.get(name, {}).pop(key, None)
    return d


def _flat(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _same(saved: dict, current: dict, what: str, advice: str) -> None:
    a, b = _flat(saved), _flat(current)
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if changed:
        raise ConfigError(f"{what} ({', '.join(changed[:8])}); {advice}")


def _source(folder: Path, option: str) -> Checkpoints:
    checkpoints = Checkpoints(folder / "checkpoints", keep=1_000_000)  # never deletes
    if checkpoints.latest() is None:
        raise ConfigError(f"{option} {folder}: that run folder holds no checkpoint")
    return checkpoints


def _restore(checkpoints: Checkpoints, step, like: dict, architecture: dict, folder: Path,
             check=None):
    """(state, meta) of a checkpoint (the latest when step is None), after checking that
    its drafter is the one this config builds and `check(meta)` (before reading arrays)."""
    step = checkpoints.latest() if step is None else step
    meta = checkpoints.restore_meta(step)
    saved = meta.get("drafter")
    if saved is not None and saved != architecture:
        changed = sorted(k for k in saved.keys() | architecture.keys()
                         if saved.get(k) != architecture.get(k))
        raise ConfigError(f"{folder} holds a drafter of another architecture "
                          f"({', '.join(changed[:8])}) than this config builds")
    if check is not None:
        check(meta)
    return checkpoints.restore(step, like)
