"""Turning one drafter pass into draft tokens and the distribution q each came from.

DFlash: every slot independently from its own marginal (argmax at T = 0).
DSpine (design doc 2.5): top-k candidates per slot from the base logits, a k x k table of
transition scores per slot (all slots in one batched op), then a walk from the anchor that
picks each successor given the chosen predecessor; q_i(. | a) = softmax over the k
candidates (zero elsewhere), so speculative sampling stays exact.

Sampling settings warp q exactly as they warp the target's p (`warp_logits`).
Shape legend: B batch, K block size, S = K - 1 drafted slots, C candidates, V vocab,
D hidden.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dspine_jax.drafters.model import BlockDrafter, DraftOutput
from dspine_jax.sampling import SamplingParams, top_k_indices, warp_logits


@struct.dataclass
class Proposal:
    tokens: jax.Array  # [B, S] drafted tokens for slots 1 .. K-1
    q: jax.Array       # [B, S, V] the distribution each was drawn from (one-hot at T = 0)


def _sample(logits: jax.Array, sampling: SamplingParams, rng: jax.Array):
    """Per-row: argmax and its one-hot at T = 0, else a draw from the warped softmax."""
    if sampling.all_greedy:
        greedy = jnp.argmax(logits, -1)
        return greedy.astype(jnp.int32), jax.nn.one_hot(greedy, logits.shape[-1])
    warped = warp_logits(logits, sampling)
    probs = jax.nn.softmax(warped, -1)
    greedy = jnp.argmax(logits, -1)
    drawn = jax.random.categorical(rng, warped, axis=-1)
    hot = (sampling.temperature > 0).reshape((-1,) + (1,) * (logits.ndim - 2))
    choice = jnp.where(hot, drawn, greedy)
    probs = jnp.where(hot[..., None], probs, jax.nn.one_hot(greedy, logits.shape[-1]))
    return choice.astype(jnp.int32), probs


def propose_marginal(out: DraftOutput, sampling: SamplingParams, rng: jax.Array) -> Proposal:
    """DFlash's rule: each slot from its own distribution."""
    tokens, q = _sample(out.logits[:, 0, 1:], sampling, rng)
    return Proposal(tokens=tokens, q=q)


def propose_chain(drafter: BlockDrafter, out: DraftOutput, anchor: jax.Array,
                  output_embedding: jax.Array, sampling: SamplingParams,
                  rng: jax.Array) -> Proposal:
    """DSpine's predecessor-conditioned decoding with the transition cache."""
    base = out.logits[:, 0, 1:]                                         # [B, S, V]
    b, s, vocab = base.shape
    c = min(drafter.config.dspine.top_k, vocab)
    candidates = top_k_indices(base, c)                                 # [B, S, C]
    # Predecessor candidates of slot i: the anchor for slot 1, slot i-1's candidates after.
    preds = jnp.concatenate([jnp.broadcast_to(anchor[:, None, None], (b, 1, c)),
                             candidates[:, :-1]], axis=1)               # [B, S, C]
    rows = jnp.take(output_embedding, candidates, axis=0)               # [B, S, C, D]
    table = drafter.transition_scores(out.pre_injection[:, 0, 1:], preds, rows,
                                      output_embedding)                # [B, S, C, C]

    def step(pred_index, inputs):
        scores, cands, key = inputs                                     # [B, C, C], [B, C]
        given = jnp.take_along_axis(scores, pred_index[:, None, None], 1)[:, 0]  # [B, C]
        choice, probs = _sample(given, sampling, key)
        token = jnp.take_along_axis(cands, choice[:, None], 1)[:, 0]
        q = jnp.zeros((b, vocab), jnp.float32).at[jnp.arange(b)[:, None], cands].set(probs)
        return choice, (token, q)

    keys = jax.random.split(rng, s)
    start = jnp.zeros((b,), jnp.int32)                                  # the anchor
    _, (tokens, q) = jax.lax.scan(step, start, (jnp.moveaxis(table, 1, 0),
                                                jnp.moveaxis(candidates, 1, 0), keys))
    return Proposal(tokens=jnp.moveaxis(tokens, 0, 1), q=jnp.moveaxis(q, 0, 1))


def propose(drafter: BlockDrafter, out: DraftOutput, anchor, output_embedding, sampling,
            rng) -> Proposal:
    spine = drafter.config.dspine
    if spine is not None and spine.refinement_head:
        return propose_chain(drafter, out, anchor, output_embedding, sampling, rng)
    return propose_marginal(out, sampling, rng)
