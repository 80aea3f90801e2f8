"""Training blocks: anchors, labels and the target's per-slot distributions.

Block j of a row starts at anchor a_j; slot k (1 <= k < K) predicts the token at a_j + k,
and the target's own distribution for that token is its output at position a_j + k - 1.
Shape legend: B batch, T sequence, n blocks per row, K block size, D hidden, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_anchors(rng: jax.Array, loss_mask: jax.Array, num_blocks: int):
    """Random anchors [B, n] (distinct, sorted) among positions whose next token is a
    response token, and a validity mask [B, n] for rows with fewer such positions."""
    b, t = loss_mask.shape
    eligible = jnp.concatenate([loss_mask[:, 1:], jnp.zeros((b, 1), bool)], axis=1)
    keys = jax.random.uniform(rng, (b, t))
    score = jnp.where(eligible, keys, -1.0)
    top, anchors = jax.lax.top_k(score, num_blocks)
    valid = top >= 0
    order = jnp.argsort(jnp.where(valid, anchors, t), axis=1)
    return (jnp.take_along_axis(anchors, order, 1).astype(jnp.int32),
            jnp.take_along_axis(valid, order, 1))


def block_labels(tokens: jax.Array, loss_mask: jax.Array, anchors: jax.Array,
                 anchor_valid: jax.Array, block_size: int):
    """labels [B, n, K] and supervised [B, n, K]: the contiguous run of response tokens
    from slot 1 (slot 0 is the anchor and never supervised)."""
    t = tokens.shape[1]
    positions = anchors[..., None] + jnp.arange(block_size)              # [B, n, K]
    inside = positions < t
    flat = jnp.clip(positions, 0, t - 1).reshape(tokens.shape[0], -1)
    labels = jnp.take_along_axis(tokens, flat, 1).reshape(positions.shape)
    in_response = jnp.take_along_axis(loss_mask, flat, 1).reshape(positions.shape) & inside
    slot = jnp.arange(block_size)
    in_response = in_response & (slot > 0) & anchor_valid[..., None]
    # Stop at the first slot outside the response (slot 0 counts as inside).
    run = jnp.cumprod(jnp.where(slot == 0, True, in_response).astype(jnp.int32), axis=-1)
    return labels, (run > 0) & (slot > 0)


def target_slot_hidden(final_hidden: jax.Array, anchors: jax.Array,
                       block_size: int) -> jax.Array:
    """The target's final hidden state that predicts each slot's token: its output at
    anchor + k - 1. final_hidden [B, T, D] (after the target's final norm) -> [B, n, K, D]."""
    b, t, d = final_hidden.shape
    positions = jnp.clip(anchors[..., None] + jnp.arange(block_size) - 1, 0, t - 1)
    rows = jnp.take_along_axis(final_hidden, positions.reshape(b, -1)[..., None], axis=1)
    return rows.reshape(*positions.shape, d)


def target_slot_logits(final_hidden: jax.Array, anchors: jax.Array, block_size: int,
                       output_embedding: jax.Array) -> jax.Array:
    """The target's logits for each slot's token (`target_slot_hidden` against the
    lm_head) -> [B, n, K, V] float32."""
    rows = target_slot_hidden(final_hidden, anchors, block_size)
    return jnp.einsum("BnKD,VD->BnKV", rows, output_embedding.astype(rows.dtype),
                      preferred_element_type=jnp.float32)


def predecessor_tokens(tokens: jax.Array, anchors: jax.Array, block_size: int) -> jax.Array:
    """[B, n, K]: slot k's true predecessor, the token at anchor + k - 1 (slot 1's is the
    anchor itself; slot 0's, clipped to the sequence, is never used)."""
    b, t = tokens.shape
    positions = jnp.clip(anchors[..., None] + jnp.arange(block_size) - 1, 0, t - 1)
    return jnp.take_along_axis(tokens, positions.reshape(b, -1), 1).reshape(positions.shape)


def training_mask(ctx_visible: jax.Array, block_size: int, causal: bool) -> jax.Array:
    """ctx_visible [B, n, S] (which context keys each block sees) -> training's
    block-diagonal mask [B, n*K, S + n*K]: every slot sees its block's visible context and
    its own block (causal: only the slots up to itself), no other block."""
    b, n, s = ctx_visible.shape
    k = block_size
    block = jnp.arange(n * k) // k
    slot = jnp.arange(n * k) % k
    inside = block[:, None] == block[None, :]
    if causal:
        inside &= slot[None, :] <= slot[:, None]
    ctx = jnp.repeat(ctx_visible, k, axis=1)
    return jnp.concatenate([ctx, jnp.broadcast_to(inside, (b, n * k, n * k))], -1)
