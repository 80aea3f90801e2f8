"""One jitted training step: the frozen target's features, fresh anchors, the drafter's
loss and gradient per device (explicit data parallelism), the optimizer update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from dspine_jax.drafters.blocks import (block_labels, predecessor_tokens, sample_anchors,
                                        target_slot_hidden, target_slot_logits)
from dspine_jax.drafters.config import DrafterConfig
from dspine_jax.losses import drafter_loss, teacher_replacement_probability
from dspine_train import sharding
from dspine_train.config import TrainConfig


def make_step(cfg: TrainConfig, target_graph, drafter_graph, tx, loss_config,
              drafter_config: DrafterConfig, compute_dtype, mesh, *, target_attention=None,
              drafter_attention=None):
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
    state stay split between steps and are gathered for the loss.

    target_attention, drafter_attention: the frozen target's and the drafter's attention
    backends (default: dense XLA)."""
    k = drafter_config.block_size
    n = cfg.data.blocks_per_seq
    ids = drafter_config.target_layer_ids
    needs_target = loss_config.reads_p_target
    replacing = loss_config.teacher_replacement and drafter_config.injecting

    def all_sum(x):
        return jax.lax.psum(x, sharding.BATCH_AXES)

    def local_grads(params, rest, e_in, e_out, step, tokens, loss_mask, features,
                    final_hidden, anchors, valid, replace):
        """One device's rows [b, ...]: (the whole batch's gradient, its metrics)."""
        labels, supervised = block_labels(tokens, loss_mask, anchors, valid, k)
        target_logits = target_hidden = None
        if needs_target and loss_config.fused_logits:     # no [b, n, K, V] target logits
            target_hidden = target_slot_hidden(final_hidden.astype(e_out.dtype), anchors, k)
        elif needs_target:
            target_logits = target_slot_logits(final_hidden.astype(e_out.dtype), anchors, k,
                                               e_out)
        teacher = predecessor_tokens(tokens, anchors, k)

        def loss_fn(params):
            cast = lambda x: x.astype(compute_dtype)  # noqa: E731
            # `rest` (DSpine's fixed transfer basis) stays float32.
            drafter = nnx.merge(drafter_graph, jax.tree.map(cast, params), rest)
            # Activations follow the drafter's own dtype (float32 as built for training);
            # without this the bf16 weights meet float32 inputs and every matmul runs in f32.
            drafter.dtype = compute_dtype
            draft = drafter.forward_train(tokens, features, anchors, e_in, e_out,
                                          attention=drafter_attention, replace=replace,
                                          replace_layers=loss_config.replacement_layers,
                                          logits=not loss_config.fused_logits)
            return drafter_loss(loss_config, drafter, draft, labels, supervised,
                                target_logits=target_logits, target_hidden=target_hidden,
                                teacher_tokens=teacher,
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
            out = target(tokens, hidden_layer_ids=ids, return_logits=False,
                         attention=target_attention)
            features = out.features()
            final_hidden = out.final_hidden
        features = jax.lax.stop_gradient(features)
        final_hidden = jax.lax.stop_gradient(final_hidden)
        anchors, valid = sample_anchors(anchor_key, loss_mask, n)
        replace = jnp.zeros(anchors.shape, bool)  # read only where the switch is on
        if replacing:
            p = teacher_replacement_probability(
                step / cfg.run.steps, loss_config.replacement_hold_ratio,
                loss_config.replacement_end_ratio, loss_config.replacement_probability)
            replace = jax.random.bernoulli(replace_key, p, anchors.shape)

        grads, metrics = sharded_grads(params, rest, target.input_embedding(),
                                       target.output_embedding(), step, tokens, loss_mask,
                                       features, final_hidden, anchors, valid, replace)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return params, opt_state, step + 1, rng, metrics

    return step
