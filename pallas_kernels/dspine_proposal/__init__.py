"""DSpine's proposal: candidates per slot straight from the drafter's hidden states, the
C x C transition table and the chain walk, with no vocabulary-sized tensor per slot.

`vocab_top_k(hidden, weight, k)`: the k largest logits hidden @ weight^T per row and their
ids, computed tile by tile over the vocabulary with a running top-k, so the [R, V] logits
are never written out. Implementations: "xla" (the full logits, then `top_k.top_k`:
two stages over the vocabulary on a GPU, lax.top_k elsewhere; what the CPU runs; the
reference is reference.py), "pallas_tpu" (tpu.py, Mosaic TPU), "pallas_gpu" (gpu.py,
Pallas Triton lowering, split over the vocabulary); "auto" picks pallas_gpu on CUDA,
pallas_tpu on TPU and xla elsewhere.

`dspine_proposal(...)`: the whole DSpine decoding head: `vocab_top_k` of the slots' final
hidden states (the kernel), then the transition table of every adjacent candidate pair and
the walk from the anchor (plain JAX on [B, S, C, C]: every slot's pick given every
predecessor at once, then S gathers of one index per row; not fused into the kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .common import IMPLEMENTATIONS, check_inputs
from ..platform import backend_implementation
from ..switches import current
from ..top_k import top_k
from .reference import (TransitionWeights, follow_chain, predecessor_rows, transition_table,
                        vocab_logits, vocab_top_k_reference, walk_chain, warp_small)

__all__ = ["vocab_top_k", "vocab_top_k_reference", "dspine_proposal", "TransitionWeights",
           "transition_table", "walk_chain", "warp_small", "follow_chain", "predecessor_rows",
           "IMPLEMENTATIONS"]


def vocab_top_k_xla(hidden, weight, k: int):
    """The reference's full logits, then `top_k.top_k` (two stages over the vocabulary on a
    GPU: XLA's one-pass TopK gives each row one thread block)."""
    return top_k(vocab_logits(hidden, weight), k)


def vocab_top_k(hidden, weight, k: int, *, implementation="auto", interpret=False):
    """The k largest entries of hidden @ weight^T per row.

    Args:
      hidden: [R, D] bf16/f32 (the drafter's final hidden states, one row per slot).
      weight: [V, D] the lm_head (cast to hidden's dtype; products accumulate in f32).
      k: static, 1 <= k <= V.
      implementation: "auto" | "xla" | "pallas_tpu" | "pallas_gpu" ("xla": the full
        logits, then `vocab_top_k_xla`).
      interpret: run a Pallas implementation in interpret mode (CPU tests).

    Returns:
      (values [R, k] float32 descending, ids [R, k] int32); equal values keep the lower id
      first, as lax.top_k does.
    """
    # the switches in effect are a static argument: a program is cached per switches
    return _vocab_top_k(hidden, weight, k, implementation=implementation,
                        interpret=interpret, switches=current())


@functools.partial(jax.jit, static_argnames=("k", "implementation", "interpret", "switches"))
def _vocab_top_k(hidden, weight, k: int, *, implementation, interpret, switches):
    with switches.active():
        check_inputs(hidden, weight, k, implementation)
        if implementation == "auto":
            implementation = backend_implementation()
        if implementation == "xla":
            return vocab_top_k_xla(hidden, weight, k)
        if implementation == "pallas_tpu":
            from .tpu import vocab_top_k_tpu
            return vocab_top_k_tpu(hidden, weight, k, interpret=interpret)
        from .gpu import vocab_top_k_gpu
        return vocab_top_k_gpu(hidden, weight, k, interpret=interpret)


def dspine_proposal(hidden, pre_injection, anchor, output_embedding,
                    weights: TransitionWeights, temperature, top_p, top_k, rng, *,
                    num_candidates: int, eps: float, greedy: bool, implementation="auto",
                    interpret=False):
    """One DSpine proposal per row.

    Args:
      hidden: [B, S, D] the drafted slots' final (normed) hidden states.
      pre_injection: [B, S, D] the last layer's states before its injection.
      anchor: [B] int32 the anchor token (slot 1's predecessor).
      output_embedding: [V, D] the target's lm_head E_out.
      weights: the last layer's write, the final norm and the transfer map.
      temperature, top_p, top_k: [B] sampling settings (temperature 0: argmax).
      rng: a key for the T > 0 draws, or [B] keys (one per row).
      num_candidates: C, static (clipped to V).
      eps: the final RMSNorm's epsilon.
      greedy: static; every row has temperature 0 (no warp is traced).

    Returns:
      (candidates [B, S, C] int32, choice [B, S] int32 index into candidates,
       q [B, S, C] float32 the distribution each choice was drawn from; one-hot at T = 0).
    """
    # the switches in effect are a static argument: a program is cached per switches
    return _dspine_proposal(hidden, pre_injection, anchor, output_embedding, weights,
                            temperature, top_p, top_k, rng, num_candidates=num_candidates,
                            eps=eps, greedy=greedy, implementation=implementation,
                            interpret=interpret, switches=current())


@functools.partial(jax.jit, static_argnames=("num_candidates", "eps", "greedy",
                                             "implementation", "interpret", "switches"))
def _dspine_proposal(hidden, pre_injection, anchor, output_embedding,
                     weights: TransitionWeights, temperature, top_p, top_k, rng, *,
                     num_candidates: int, eps: float, greedy: bool, implementation,
                     interpret, switches):
    with switches.active():
        b, s, d = hidden.shape
        c = min(num_candidates, output_embedding.shape[0])
        _, candidates = vocab_top_k(hidden.reshape(b * s, d), output_embedding, c,
                                    implementation=implementation, interpret=interpret)
        candidates = candidates.reshape(b, s, c)
        # Predecessor candidates of slot i: the anchor for slot 1, slot i-1's candidates after.
        preds = jnp.concatenate([jnp.broadcast_to(anchor[:, None, None], (b, 1, c)),
                                 candidates[:, :-1]], axis=1)
        rows = jnp.take(output_embedding, candidates, axis=0)                # [B, S, C, D]
        table = transition_table(pre_injection, preds, rows, output_embedding, weights, eps)
        choice, q = walk_chain(table, temperature, top_p, top_k, rng, greedy=greedy)
        return candidates, choice, q
