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

import csv
import json
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
from flax import nnx

from dspine_jax.checkpoints import load_target, resolve_dtype
from dspine_jax.data.shards import load_dataset, read_manifest
from dspine_jax.drafters.blocks import (block_labels, predecessor_tokens, sample_anchors,
                                        target_slot_logits)
from dspine_jax.drafters.checkpoint import load_drafter, read_drafter_config, save_drafter
from dspine_jax.drafters.config import DrafterConfig, DSpineConfig, mask_token_for
from dspine_jax.drafters.model import BlockDrafter
from dspine_jax.errors import CheckpointError, ConfigError, InputError
from dspine_jax.losses import LossConfig, drafter_loss, teacher_replacement_probability
from train import sharding
from dspine_train.config import TrainConfig
from dspine_train.features import open_features


# ----- data ---------------------------------------------------------------------------------
class BatchStream:
    """Deterministic, resumable batches: epoch e visits the sequences in a permutation
    seeded by (seed, e); `position` = (epoch, index) is saved with each checkpoint."""

    def __init__(self, folder: Path, seq_len: int, batch_size: int, seed: int):
        sequences = load_dataset(folder)
        self.truncated = sum(len(s.tokens) > seq_len for s in sequences)
        usable = [s for s in sequences if s.loss_mask[1:seq_len].any()]
        if len(usable) < batch_size:
            raise InputError(f"{folder}: {len(usable)} usable sequences, fewer than the batch "
                             f"size {batch_size}")
        self.tokens = np.zeros((len(usable), seq_len), np.int32)
        self.mask = np.zeros((len(usable), seq_len), bool)
        for i, s in enumerate(usable):
            n = min(len(s.tokens), seq_len)
            self.tokens[i, :n] = s.tokens[:n]
            self.mask[i, :n] = s.loss_mask[:n]
        self.batch_size, self.seed = batch_size, seed
        self.epoch, self.index = 0, 0

    @property
    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def seek(self, position: dict) -> None:
        self.epoch, self.index = position["epoch"], position["index"]

    def next(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, loss_mask, row indices) of the next global batch."""
        if self.index + self.batch_size > len(self.tokens):
            self.epoch, self.index = self.epoch + 1, 0
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.tokens))
        rows = order[self.index:self.index + self.batch_size]
        self.index += self.batch_size
        return self.tokens[rows], self.mask[rows], rows


def local_rows(array: np.ndarray) -> np.ndarray:
    """This process's share of a global batch."""
    per = len(array) // jax.process_count()
    return array[jax.process_index() * per:(jax.process_index() + 1) * per]


# ----- model set-up ---------------------------------------------------------------------
def drafter_config(cfg: TrainConfig, target) -> DrafterConfig:
    """The drafter a config describes (read from init_from when it names a checkpoint)."""
    d = cfg.drafter
    if d.init_from:
        config = read_drafter_config(Path(d.init_from))
        config.check_target(target.config)
        return config
    spine = None
    if d.kind == "dspine":
        default = DrafterConfig.default_dspine(target.config.hidden_size)
        spine = DSpineConfig(
            transfer_rank=d.transfer_rank or default.transfer_rank,
            message_size=d.message_size or default.message_size, top_k=d.top_k,
            injection=d.injection, teacher_replacement=d.teacher_replacement,
            causal_block=d.causal_block, alignment=d.alignment,
            refinement_head=d.refinement_head)
    mask = d.mask_token_id if d.mask_token_id >= 0 else mask_token_for(target.tokenizer)
    return DrafterConfig.for_target(target.config, kind=d.kind, num_layers=d.layers,
                                    mask_token_id=mask, block_size=d.block_size, dspine=spine)


def build_drafter(cfg: TrainConfig, target) -> BlockDrafter:
    if cfg.drafter.init_from:
        drafter = load_drafter(Path(cfg.drafter.init_from), dtype=jnp.float32)
        drafter.config.check_target(target.config)
        return drafter
    return BlockDrafter.create(drafter_config(cfg, target), target.model.output_embedding(),
                               seed=cfg.run.seed)


def split_drafter(drafter: BlockDrafter):
    """(graph, trainable params as float32 master weights, the rest: DSpine's fixed
    transfer basis, kept as it is)."""
    graph, params, rest = nnx.split(drafter, nnx.Param, ...)
    return graph, jax.tree.map(lambda x: x.astype(jnp.float32), params), rest


def make_optimizer(cfg: TrainConfig):
    """AdamW with linear warm-up then cosine decay to 0, after global-norm clipping."""
    o = cfg.optim
    warmup = max(1, int(o.warmup_ratio * cfg.run.steps))
    schedule = optax.warmup_cosine_decay_schedule(0.0, o.lr, warmup, max(cfg.run.steps, warmup + 1))
    tx = optax.chain(optax.clip_by_global_norm(o.clip),
                     optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))
    return tx, schedule


def flops_per_step(target_config, drafter: BlockDrafter, batch: int, seq_len: int,
                   blocks: int) -> float:
    """Matmul FLOPs: target forward, drafter forward + backward over the block tokens and
    the context projections, and the vocabulary products."""
    dc = drafter.config
    block_tokens = batch * blocks * dc.block_size
    h, v = dc.hidden_size, dc.vocab_size
    layer = (h * dc.head_dim * (2 * dc.num_attention_heads + 2 * dc.num_key_value_heads)
             + 3 * h * dc.intermediate_size)
    context = dc.num_features * h * h + dc.num_hidden_layers * 2 * h * dc.num_key_value_heads \
        * dc.head_dim
    # Embedding rows are gathered, not multiplied, and the target's lm_head is not run.
    embeddings = target_config.vocab_size * target_config.hidden_size * (
        1 if target_config.tie_word_embeddings else 2)
    target = 2 * (target_config.num_params() - embeddings) * batch * seq_len
    drafter_flops = 6 * dc.num_hidden_layers * layer * block_tokens + 6 * context * batch * seq_len
    vocab = (4 + 2) * v * h * block_tokens  # drafter logits fwd+bwd, target slot logits
    return float(target + drafter_flops + vocab)


# ----- the step -------------------------------------------------------------------------
def make_step(cfg: TrainConfig, target_graph, drafter_graph, tx, loss_config,
              drafter_config: DrafterConfig, compute_dtype, mesh):
    """The jitted training step. Every array it reads is an argument: a closed-over array
    would be baked into the compiled program as a constant (DSpine's transfer basis is
    [H, r]) and recompiled with every new drafter.

    Data parallelism is explicit: the target's forward pass and the random draws run on
    the whole mesh, then each device computes the drafter's loss and gradient for its own
    rows with whole (replicated) drafter parameters (shard_map: the one-device program at
    the per-device batch) and the gradients are summed across devices. XLA's automatic
    partitioning of the drafter's loss and its backward pass computed NaN (data
    parallel) and wrong DSpine terms (fsdp) on two H200s, while matching on CPU devices
    (docs/benchmarks.md, "Multi-GPU training"). Under fsdp the parameters and optimizer
    state stay split between steps and are gathered for the loss."""
    k = drafter_config.block_size
    n = cfg.data.blocks_per_seq
    spine = drafter_config.dspine
    ids = drafter_config.target_layer_ids
    needs_target = loss_config.backbone == "ce+l1" or loss_config.refinement
    replacing = spine is not None and spine.teacher_replacement

    def all_sum(x):
        return jax.lax.psum(x, sharding.BATCH_AXES)

    def local_grads(params, rest, e_in, e_out, step, tokens, loss_mask, features,
                    final_hidden, anchors, valid, replace):
        """One device's rows [b, ...]: (the whole batch's gradient, its metrics)."""
        labels, supervised = block_labels(tokens, loss_mask, anchors, valid, k)
        target_logits = (target_slot_logits(final_hidden.astype(e_out.dtype), anchors, k, e_out)
                         if needs_target else None)
        teacher = predecessor_tokens(tokens, anchors, k)

        def loss_fn(params):
            cast = lambda x: x.astype(compute_dtype)  # noqa: E731
            # `rest` (DSpine's fixed transfer basis) stays float32.
            drafter = nnx.merge(drafter_graph, jax.tree.map(cast, params), rest)
            draft = drafter.forward_train(tokens, features, anchors, e_in, e_out,
                                          replace=replace)
            return drafter_loss(loss_config, drafter, draft, labels, supervised,
                                target_logits=target_logits, teacher_tokens=teacher,
                                output_embedding=e_out, step=step, all_sum=all_sum)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        metrics["supervised_slots"] = all_sum(jnp.sum(supervised))
        return all_sum(grads), metrics

    rows = P(sharding.BATCH_AXES)
    whole = P()
    sharded_grads = jax.shard_map(
        local_grads, mesh=mesh, in_specs=(whole,) * 5 + (rows,) * 7, out_specs=(whole, whole),
        check_vma=False)  # the sums are explicit (all_sum)

    def step(target_params, rest, params, opt_state, step, rng, tokens, loss_mask,
             features=None, final_hidden=None):
        """features/final_hidden: cached target outputs, else the target runs here."""
        target = nnx.merge(target_graph, target_params)
        rng, anchor_key, replace_key = jax.random.split(rng, 3)
        if features is None:
            out = target(tokens, hidden_layer_ids=ids, return_logits=False)
            features = out.features()
            final_hidden = out.final_hidden
        features = jax.lax.stop_gradient(features)
        final_hidden = jax.lax.stop_gradient(final_hidden)
        anchors, valid = sample_anchors(anchor_key, loss_mask, n)
        replace = jnp.zeros(anchors.shape, bool)  # read only where the switch is on
        if replacing:
            p = teacher_replacement_probability(step / cfg.run.steps, spine.replacement_hold_ratio,
                                                spine.replacement_end_ratio,
                                                spine.replacement_probability)
            replace = jax.random.bernoulli(replace_key, p, anchors.shape)

        grads, metrics = sharded_grads(params, rest, target.input_embedding(),
                                       target.output_embedding(), step, tokens, loss_mask,
                                       features, final_hidden, anchors, valid, replace)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return params, opt_state, step + 1, rng, metrics

    return step


# ----- checkpoints ----------------------------------------------------------------------
def _flat(tree) -> dict:
    return {jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _unflat(flat: dict, like):
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [flat[jax.tree_util.keystr(p)] for p, _ in paths])


class Checkpoints:
    def __init__(self, folder: Path, keep: int):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.folder = folder
        self.manager = ocp.CheckpointManager(
            folder.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, meta: dict) -> None:
        ocp = self.ocp
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(_flat(state)), meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int, like: dict) -> tuple[dict, dict]:
        ocp = self.ocp
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _flat(like))
        try:
            got = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax/tensorstore raise many types on damaged files
            raise CheckpointError(
                f"checkpoint {step} in {self.folder} is unreadable ({type(e).__name__}: "
                f"{str(e)[:300]}). Nothing was overwritten; delete that step's folder to "
                "resume from an earlier one, or pick a new run.out.") from e
        return _unflat(got.state, like), got.meta

    def wait(self) -> None:
        self.manager.wait_until_finished()


# ----- metrics ------------------------------------------------------------------------------
SCALARS = ("loss", "backbone_ce", "backbone_l1", "refinement", "alignment", "coverage",
           "accept_len_estimate", "accept_len_blocks", "refined_accuracy", "gate_mean",
           "grad_norm", "lr", "tokens_per_s", "mfu")


class MetricsLog:
    """CSV of every logged step (and a PNG of the curves); process 0 only."""

    def __init__(self, path: Path, block_size: int, enabled: bool):
        self.path, self.enabled = path, enabled
        self.columns = ["step", *SCALARS] + [f"slot_acc_{k}" for k in range(1, block_size)]

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        new = not self.path.is_file()
        with open(self.path, "a", newline="") as f:
            writer = csv.DictWriter(f, self.columns, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow(row)

    def plot(self, png: Path) -> None:
        if not self.enabled or not self.path.is_file():
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        with open(self.path) as f:
            rows = list(csv.DictReader(f))
        if not rows:
            return
        steps = [int(r["step"]) for r in rows]
        panels = [("loss", ["loss", "backbone_ce", "backbone_l1", "refinement", "alignment"]),
                  ("acceptance length", ["accept_len_estimate", "accept_len_blocks"]),
                  ("accuracy", ["coverage", "refined_accuracy", "slot_acc_1", "slot_acc_4",
                                "slot_acc_8"])]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for ax, (title, keys) in zip(axes, panels):
            for key in keys:
                values = [float(r[key]) if r.get(key) not in (None, "") else np.nan for r in rows]
                if not np.all(np.isnan(values)):
                    ax.plot(steps, values, label=key)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        plt.close(fig)


# ----- the loop ---------------------------------------------------------------------------
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
    loss_config = LossConfig.for_drafter(dc, backbone=cfg.loss.backbone or None)
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

    step_fn = jax.jit(make_step(cfg, target_graph, drafter_graph, tx, loss_config, dc,
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


def peak_device_memory() -> int | None:
    """Largest peak allocation over this process's devices (None where the backend keeps no
    statistics, e.g. CPU)."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) if peaks else None


class StopRequest:
    """Stop cleanly (checkpoint, then exit) on SIGTERM — a preempted TPU host, `timeout` —
    or after `max_seconds`. Hosts agree on the step: the flags are gathered every
    `log_every` steps, so every process saves the same checkpoint."""

    def __init__(self, max_seconds: float):
        self.deadline = time.monotonic() + max_seconds if max_seconds > 0 else None
        self.signalled = False
        self._previous = None
        try:
            self._previous = signal.signal(signal.SIGTERM, self._on_term)
        except ValueError:  # not the main thread: no handler, the deadline still works
            pass

    def _on_term(self, signum, frame):
        self.signalled = True

    def now(self, step: int, every: int) -> bool:
        if step % max(every, 1):
            return False
        wanted = self.signalled or (self.deadline is not None
                                    and time.monotonic() > self.deadline)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            wanted = bool(np.any(multihost_utils.process_allgather(np.asarray(wanted))))
        return wanted

    def release(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


# bf16 dense peak (H100/H200 datasheet) for MFU; other platforms report none.
PEAK_FLOPS = {"gpu": 989e12}


def _resumable(cfg: TrainConfig) -> dict:
    """The config a resumed run must match (stop_after/max_seconds only say when to stop)."""
    d = cfg.to_dict()
    d["run"] = {k: v for k, v in d["run"].items() if k not in ("stop_after", "max_seconds")}
    return d
