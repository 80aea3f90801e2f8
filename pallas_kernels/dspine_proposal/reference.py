"""The DSpine proposal in plain JAX: the documentation of what the kernels compute.

Two parts:
  * `vocab_top_k_reference`: the k largest logits (and their ids) of hidden [R, D] against
    an output embedding [V, D], logits in float32: lax.top_k of the full [R, V] logits
    (value descending, ties to the lower id). The kernels compute the same without
    building [R, V] outside VMEM/SRAM.
  * `transition_table` and `walk_chain`: DSpine's decoding head (docs/algorithms.md,
    section 6) on the C candidates per slot: the refined state of each slot given each
    predecessor candidate's transfer code, its scores against the candidates' lm_head
    rows ([B, S, C, C]), then the walk from the anchor (argmax at T = 0, a draw from the
    warped softmax over the C candidates at T > 0: temperature, then top-k, then top-p
    over what top-k kept, as dspine_jax.sampling.warp_logits).

B batch, S drafted slots, C candidates, D hidden, r transfer rank, m message width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def vocab_logits(hidden, weight):
    """hidden [R, D], weight [V, D] -> logits [R, V] float32 (weight in hidden's dtype)."""
    return jnp.einsum("RD,VD->RV", hidden, weight.astype(hidden.dtype),
                      preferred_element_type=jnp.float32)


def vocab_top_k_reference(hidden, weight, k: int):
    """hidden [R, D], weight [V, D] -> (values [R, k] float32, ids [R, k] int32)."""
    values, ids = jax.lax.top_k(vocab_logits(hidden, weight), k)
    return values, ids.astype(jnp.int32)


class TransitionWeights(NamedTuple):
    """The last draft layer's write and the final norm, as plain arrays ([out, in] weights,
    the compute dtype of the drafter; transfer map float32)."""
    readout: jax.Array           # R_L [r, D]
    write: jax.Array             # W_L [D, m]
    message: jax.Array           # M [m, r]
    receiver_gate: jax.Array     # A [m, r]
    predecessor_gate: jax.Array  # B [m, r]
    bias: jax.Array              # b [m]
    norm_weight: jax.Array       # final RMSNorm scale [D]
    transfer_mean: jax.Array     # [D]
    transfer_whiten: jax.Array   # [D, r]


def _linear(x, w):
    return jnp.einsum("...i,oi->...o", x, w)


def _unit(x):
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def transfer_code(rows, w: TransitionWeights):
    """sqrt(r) * c for lm_head rows [..., D] -> [..., r] float32."""
    rank = w.transfer_whiten.shape[1]
    c = _unit((_unit(rows.astype(jnp.float32)) - w.transfer_mean) @ w.transfer_whiten)
    return jnp.sqrt(rank) * c


def transition_table(pre_injection, predecessors, candidate_rows, output_embedding,
                     w: TransitionWeights, eps: float):
    """pre_injection [..., D]; predecessors [..., P] ids; candidate_rows [..., C, D]
    -> scores [..., P, C] float32 (the same operations, in the same dtypes, as the drafter's
    `transition_scores`)."""
    dtype = pre_injection.dtype
    rank = w.transfer_whiten.shape[1]
    z = _linear(pre_injection, w.readout).astype(jnp.float32)
    phi = jnp.sqrt(rank) * z / jnp.maximum(jnp.linalg.norm(z, axis=-1, keepdims=True), 1e-6)
    phi = phi[..., None, :]                                             # [..., 1, r]
    h = pre_injection[..., None, :]                                     # [..., 1, D]
    pred = transfer_code(jnp.take(output_embedding, predecessors, axis=0), w)  # [..., P, r]
    gate = jax.nn.sigmoid((_linear(phi.astype(dtype), w.receiver_gate)
                           + _linear(pred.astype(dtype), w.predecessor_gate)
                           + w.bias).astype(jnp.float32))
    msg = _linear(pred.astype(dtype), w.message).astype(jnp.float32)
    h32 = h.astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True))
    delta = (rms * _linear((gate * msg).astype(dtype), w.write).astype(jnp.float32)).astype(dtype)
    x = h + delta
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    refined = x32.astype(dtype) * w.norm_weight.astype(dtype)           # [..., P, D]
    return jnp.einsum("...PD,...CD->...PC", refined, candidate_rows.astype(dtype),
                      preferred_element_type=jnp.float32)


def warp_small(logits, temperature, top_p, top_k):
    """warp_logits for a short last axis: logits [B, C] -> scaled, -inf outside the
    top-k / top-p set (temperature 0 rows scaled by 1)."""
    c = logits.shape[-1]
    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, c), c)[:, None]
    rank = jnp.arange(c)
    sorted_desc = jnp.where(rank < k, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    keep = ((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]) & (rank < k)
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
    threshold = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def walk_chain(table, temperature, top_p, top_k, rng, *, greedy: bool):
    """table [B, S, C, C] (row: the predecessor candidate; slot 0's rows all given the
    anchor) -> (choice [B, S] candidate index, q [B, S, C]). Start at row 0 (the anchor);
    each slot takes the row of the chosen predecessor. greedy (static): every row argmax.
    rng: one key, or [B] keys (row b draws from key b only)."""
    b, s, c, _ = table.shape

    def step(pred_index, inputs):
        scores, key = inputs
        given = jnp.take_along_axis(scores, pred_index[:, None, None], 1)[:, 0]  # [B, C]
        best = jnp.argmax(given, -1).astype(jnp.int32)
        hot_best = jax.nn.one_hot(best, c, dtype=jnp.float32)
        if greedy:
            return best, (best, hot_best)
        warped = warp_small(given, temperature, top_p, top_k)
        if key.ndim == 0:
            drawn = jax.random.categorical(key, warped, axis=-1).astype(jnp.int32)
        else:   # one key per row: a row's draw does not depend on the batch
            drawn = jax.vmap(lambda k, x: jax.random.categorical(k, x))(key, warped)
            drawn = drawn.astype(jnp.int32)
        hot = (temperature > 0)[:, None]
        choice = jnp.where(hot[:, 0], drawn, best)
        q = jnp.where(hot, jax.nn.softmax(warped, -1), hot_best)
        return choice, (choice, q)

    if rng.ndim == 0:
        keys = jax.random.split(rng, s)                                 # [S]
    else:
        keys = jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, s))(rng), 0, 1)  # [S, B]
    # Unrolled: S is small and static, and a GPU while loop waits on the host for its
    # predicate at every step (S round trips per pass).
    _, (choice, q) = jax.lax.scan(step, jnp.zeros((b,), jnp.int32),
                                  (jnp.moveaxis(table, 1, 0), keys), unroll=True)
    return jnp.moveaxis(choice, 0, 1), jnp.moveaxis(q, 0, 1)
