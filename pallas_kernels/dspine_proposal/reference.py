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

from pallas_kernels import switches


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
    the compute dtype of the drafter), and the transfer space in float32: the whitening
    map (`transfer_mean`, `transfer_whiten`: codes from lm_head rows) or the code table
    (`transfer_codes`: codes by token id), whichever the drafter holds."""
    readout: jax.Array           # R_L [r, D]
    write: jax.Array             # W_L [D, m]
    message: jax.Array           # M [m, r]
    receiver_gate: jax.Array     # A [m, r]
    predecessor_gate: jax.Array  # B [m, r]
    bias: jax.Array              # b [m]
    norm_weight: jax.Array       # final RMSNorm scale [D]
    transfer_mean: jax.Array | None = None    # [D]
    transfer_whiten: jax.Array | None = None  # [D, r]
    transfer_codes: jax.Array | None = None   # [V, r]


def _linear(x, w):
    return jnp.einsum("...i,oi->...o", x, w)


def _unit(x):
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def transfer_code(tokens, output_embedding, w: TransitionWeights):
    """sqrt(r) * c for token ids [...] -> [..., r] float32: a row of the code table, or
    unit((unit(E_out[token]) - mean) @ whiten) from the whitening map."""
    rank = w.readout.shape[0]
    if w.transfer_codes is not None:
        c = jnp.take(w.transfer_codes, tokens, axis=0).astype(jnp.float32)
    else:
        rows = jnp.take(output_embedding, tokens, axis=0).astype(jnp.float32)
        c = _unit((_unit(rows) - w.transfer_mean) @ w.transfer_whiten)
    return jnp.sqrt(rank) * c


def transition_table(pre_injection, predecessors, candidate_rows, output_embedding,
                     w: TransitionWeights, eps: float):
    """pre_injection [..., D]; predecessors [..., P] ids; candidate_rows [..., C, D]
    -> scores [..., P, C] float32 (the same operations, in the same dtypes, as the drafter's
    `transition_scores`)."""
    dtype = pre_injection.dtype
    rank = w.readout.shape[0]
    z = _linear(pre_injection, w.readout).astype(jnp.float32)
    phi = jnp.sqrt(rank) * z / jnp.maximum(jnp.linalg.norm(z, axis=-1, keepdims=True), 1e-6)
    phi = phi[..., None, :]                                             # [..., 1, r]
    h = pre_injection[..., None, :]                                     # [..., 1, D]
    pred = transfer_code(predecessors, output_embedding, w)            # [..., P, r]
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
    """warp_logits for a short last axis: logits [B, ..., C] -> scaled, -inf outside the
    top-k / top-p set (temperature 0 rows scaled by 1); settings [B]."""
    c = logits.shape[-1]
    per_row = lambda x: x.reshape(x.shape + (1,) * (logits.ndim - 1))  # noqa: E731
    scaled = logits.astype(jnp.float32) / per_row(jnp.where(temperature > 0, temperature, 1.0))
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = per_row(jnp.where(top_k > 0, jnp.minimum(top_k, c), c))
    rank = jnp.arange(c)
    sorted_desc = jnp.where(rank < k, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    keep = ((jnp.cumsum(probs, axis=-1) - probs) < per_row(top_p)) & (rank < k)
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
    threshold = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def follow_chain(choices):
    """choices [B, S, C] int32: slot i's pick given each candidate of slot i-1 (slot 0's
    rows all given the anchor) -> [B, S] the picks along the walk from the anchor (row 0).
    S dependent gathers of one index per row, with no reduction between them for XLA to
    launch apart."""
    b, s, _ = choices.shape
    pred = jnp.zeros((b,), jnp.int32)
    picked = []
    for i in range(s):
        pred = jnp.take_along_axis(choices[:, i], pred[:, None], 1)[:, 0]
        picked.append(pred)
    return jnp.stack(picked, 1)


def predecessor_rows(rows, choice):
    """rows [B, S, C, X] (one row per predecessor candidate), choice [B, S] the walk ->
    [B, S, X]: each slot's row for the predecessor the walk took (slot 0: row 0)."""
    pred = jnp.concatenate([jnp.zeros_like(choice[:, :1]), choice[:, :-1]], 1)
    return jnp.take_along_axis(rows, pred[:, :, None, None], 2)[:, :, 0]


def walk_at_once() -> bool:
    """How a sampled `walk_chain` draws: every slot's pick given every predecessor at once,
    or slot by slot. On GPUs at once: each step of a slot-by-slot walk is a dozen small
    kernels (sort, softmax, cumsum, draw), 15 steps in sequence. On CPUs slot by slot:
    there the work counts, and at once warps C times as many rows (timings of both:
    docs/benchmarks.md, "PyTorch port and kernels"). The `chain_walk` switch (all|steps;
    DSPINE_CHAIN_WALK) overrides. Both are exact; their draws differ. Greedy walks always
    go at once (the same picks)."""
    mode = switches.current().chain_walk
    return mode == "all" or (mode == "auto" and jax.default_backend() == "gpu")


def walk_chain(table, temperature, top_p, top_k, rng, *, greedy: bool):
    """table [B, S, C, C] (row: the predecessor candidate; slot 0's rows all given the
    anchor) -> (choice [B, S] candidate index, q [B, S, C]). Start at row 0 (the anchor);
    each slot takes the row of the chosen predecessor: argmax at T = 0, else a draw from
    the warped softmax. greedy (static): every row argmax. rng: one key, or [B] keys (row
    b draws from key b only).

    At once (`walk_at_once`): one warp and one draw over [B, S, C, C], each table row
    with its own noise, then `follow_chain` walks the picks. Each pick the walk takes was
    drawn from its own row with noise no other taken pick used, so the chain has exactly
    the slot-by-slot distribution."""
    c = table.shape[-1]
    if greedy:
        choice = follow_chain(jnp.argmax(table, -1).astype(jnp.int32))
        return choice, jax.nn.one_hot(choice, c, dtype=jnp.float32)
    if walk_at_once():
        picks, probs = _sample_rows(table, temperature, top_p, top_k, rng)
        choice = follow_chain(picks)
        return choice, predecessor_rows(probs, choice)

    def step(pred_index, inputs):
        scores, key = inputs
        given = jnp.take_along_axis(scores, pred_index[:, None, None], 1)[:, 0]  # [B, C]
        choice, q = _sample_rows(given, temperature, top_p, top_k, key)
        return choice, (choice, q)

    s = table.shape[1]
    if rng.ndim == 0:
        keys = jax.random.split(rng, s)                                 # [S]
    else:
        keys = jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, s))(rng), 0, 1)  # [S, B]
    # Unrolled: S is small and static, and a GPU while loop waits on the host for its
    # predicate at every step (S round trips per pass).
    _, (choice, q) = jax.lax.scan(step, jnp.zeros((table.shape[0],), jnp.int32),
                                  (jnp.moveaxis(table, 1, 0), keys), unroll=True)
    return jnp.moveaxis(choice, 0, 1), jnp.moveaxis(q, 0, 1)


def _sample_rows(scores, temperature, top_p, top_k, rng):
    """scores [B, ..., C] -> (picks [B, ...] int32, probs [B, ..., C]): per row b the
    argmax and its one-hot at temperature 0, else a draw from the warped softmax and that
    softmax. rng: one key, or [B] keys."""
    c = scores.shape[-1]
    best = jnp.argmax(scores, -1).astype(jnp.int32)
    warped = warp_small(scores, temperature, top_p, top_k)
    if rng.ndim == 0:
        drawn = jax.random.categorical(rng, warped, axis=-1)
    else:   # one key per row: a row's draws do not depend on the batch
        drawn = jax.vmap(lambda k, x: jax.random.categorical(k, x, axis=-1))(rng, warped)
    hot = (temperature > 0).reshape((-1,) + (1,) * (scores.ndim - 2))
    picks = jnp.where(hot, drawn.astype(jnp.int32), best)
    probs = jnp.where(hot[..., None], jax.nn.softmax(warped, -1),
                      jax.nn.one_hot(best, c, dtype=jnp.float32))
    return picks, probs
