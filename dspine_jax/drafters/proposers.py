"""Each drafter's proposer: the arrays a drafter pass turns into a proposal.

`BlockDrafter.proposer(impl)` returns one of these; the engine calls only its `propose`.

  impl="sparse" (default)
    DFlash  `sample_marginal`: argmax at T = 0 (through TopK), else the warp's threshold
            from a partial top-k and an inverse-CDF draw; q stays implicit (logits + the
            warp's threshold and normaliser, `MarginalProposal`).
    DSpine  `pallas_kernels.dspine_proposal`: top-C candidates straight from the final
            hidden states (`vocab_top_k`, by `kernel_implementation`: "xla", the
            default, XLA's TopK over the full logits; "pallas" the platform's Pallas kernel,
            interpreted where none compiles (CPU); "auto" the Pallas kernel on GPU/TPU and
            XLA elsewhere; either way the drafter's own [S, V] logits are dead code), the
            C x C transition table and the walk; q over the C candidates only
            (`CandidateProposal`). At T > 0 the config's `chain_temperature` scales the
            chain's warp, and `marginal_tail` gives q the base marginal outside the
            candidates (`walk_chain_with_tail`, `SplicedProposal`; the base logits are
            used then, and the table is built as on the dense path); `vocabulary_chain`
            draws each slot from the head's row over the whole vocabulary given the
            drawn predecessor (`walk_vocabulary_chain`, a `MarginalProposal`).
  impl="dense"
    The original path, kept for comparison: q [B, S, V] for every slot, warped by a full
    sort of the vocabulary (`Proposal`).

Shape legend: B batch, K block size, S = K - 1 drafted slots, C candidates, V vocab.
"""

from __future__ import annotations

import jax.numpy as jnp

from dspine_jax.drafters import DEFAULT_PROPOSAL_KERNEL, PROPOSALS
from dspine_jax.layers import einsum_f32
from dspine_jax.sampling import SamplingParams, top_k_indices
from dspine_jax.speculative.propose import (CandidateProposal, Proposal, SplicedProposal,
                                            sample_dense, sample_marginal, walk_chain,
                                            walk_chain_with_tail, walk_vocabulary_chain)

PROPOSAL_IMPLS = PROPOSALS
# vocab_top_k's own implementation names are taken as they are (benchmarks time each), and
# always compiled: "pallas_tpu" lowers the Mosaic TPU kernel from any host (what
# `dspine_benchmarks.lower_for_tpu` checks), though only a TPU runs it.
KERNEL_IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_gpu", "pallas_tpu")


def check_impl(impl: str) -> None:
    if impl not in PROPOSAL_IMPLS:
        raise ValueError(f"proposal implementation must be one of {PROPOSAL_IMPLS}, got {impl!r}")


def kernel_call(kernel: str) -> tuple[str, bool]:
    """vocab_top_k's (implementation, interpret) for a proposal kernel name. "pallas" is the
    platform's Pallas kernel, or the GPU kernel in interpret mode where none compiles (the
    CPU: slow, for tests), as the pallas attention backend does. "pallas_gpu" and
    "pallas_tpu" name one platform's kernel, compiled whatever the host (a program lowered
    for that platform holds it)."""
    from pallas_kernels.platform import backend_implementation

    if kernel not in KERNEL_IMPLEMENTATIONS:
        raise ValueError(f"proposal kernel must be one of {KERNEL_IMPLEMENTATIONS}, "
                         f"got {kernel!r}")
    if kernel != "pallas":
        return kernel, False
    native = backend_implementation()
    return (native, False) if native != "xla" else ("pallas_gpu", True)


class MarginalProposer:
    """DFlash's rule: every slot from its own distribution."""

    def __init__(self, impl: str = "sparse"):
        check_impl(impl)
        self.impl = impl

    def propose(self, out, anchor, output_embedding, sampling: SamplingParams, rng):
        logits = out.logits[:, 0, 1:]                                     # [B, S, V]
        if self.impl == "dense":
            tokens, q = sample_dense(logits, sampling, rng)
            return Proposal(tokens=tokens, q=q)
        return sample_marginal(logits, sampling, rng)


class ChainProposer:
    """DSpine's predecessor-conditioned decoding with the transition cache."""

    def __init__(self, drafter, impl: str = "sparse",
                 kernel_implementation: str = DEFAULT_PROPOSAL_KERNEL):
        check_impl(impl)
        self.drafter = drafter
        self.impl = impl
        self.kernel_implementation = kernel_implementation
        self.kernel_call = kernel_call(kernel_implementation)  # (implementation, interpret)

    def transition_weights(self):
        from pallas_kernels.dspine_proposal import TransitionWeights

        d = self.drafter
        last = d.config.num_hidden_layers - 1
        inj = d.injection
        return TransitionWeights(
            readout=inj.readouts[last].weight[...], write=inj.writes[last].weight[...],
            message=inj.message.weight[...], receiver_gate=inj.receiver_gate.weight[...],
            predecessor_gate=inj.predecessor_gate.weight[...], bias=inj.bias[...],
            norm_weight=d.norm.weight[...],
            **({"transfer_codes": d.transfer_codes[...]} if d.has_code_table else
               {"transfer_mean": d.transfer_mean[...], "transfer_whiten": d.transfer_whiten[...]}))

    def chain_sampling(self, sampling: SamplingParams) -> SamplingParams:
        """The warp of the chain's scores: T * chain_temperature (T = 0 stays argmax)."""
        t = self.drafter.config.dspine.chain_temperature
        return sampling if t == 1.0 else sampling.replace(temperature=sampling.temperature * t)

    def propose(self, out, anchor, output_embedding, sampling: SamplingParams, rng):
        spine = self.drafter.config.dspine
        if (spine.vocabulary_chain or spine.marginal_tail) and not sampling.all_greedy:
            walk = self._vocabulary_chain if spine.vocabulary_chain else self._spliced
            proposal = walk(out, anchor, output_embedding, sampling, rng)
            return Proposal(tokens=proposal.tokens, q=proposal.dense_q()) \
                if self.impl == "dense" else proposal
        if self.impl == "dense":
            return self._dense(out, anchor, output_embedding, self.chain_sampling(sampling), rng)
        from pallas_kernels.dspine_proposal import dspine_proposal

        d = self.drafter
        chain = self.chain_sampling(sampling)
        candidates, choice, q = dspine_proposal(
            out.hidden[:, 0, 1:], out.pre_injection[:, 0, 1:], anchor, output_embedding,
            self.transition_weights(), chain.temperature, chain.top_p, chain.top_k,
            rng, num_candidates=d.config.dspine.top_k, eps=float(d.norm.eps),
            greedy=sampling.all_greedy, implementation=self.kernel_call[0],
            interpret=self.kernel_call[1])
        tokens = jnp.take_along_axis(candidates, choice[..., None], -1)[..., 0]
        q_tokens = jnp.take_along_axis(q, choice[..., None], -1)[..., 0]
        return CandidateProposal(tokens=tokens, q_tokens=q_tokens, candidates=candidates, q=q,
                                 vocab_size=output_embedding.shape[0])

    def _table(self, out, anchor, output_embedding):
        """Candidates [B, S, C] from the base logits and the C x C table [B, S, C, C]."""
        base = out.logits[:, 0, 1:]                                       # [B, S, V]
        b, _, vocab = base.shape
        c = min(self.drafter.config.dspine.top_k, vocab)
        candidates = top_k_indices(base, c)                               # [B, S, C]
        preds = jnp.concatenate([jnp.broadcast_to(anchor[:, None, None], (b, 1, c)),
                                 candidates[:, :-1]], axis=1)             # [B, S, C]
        rows = jnp.take(output_embedding, candidates, axis=0)             # [B, S, C, D]
        return candidates, self.drafter.transition_scores(
            out.pre_injection[:, 0, 1:], preds, rows, output_embedding)

    def _spliced(self, out, anchor, output_embedding, sampling, rng) -> SplicedProposal:
        """marginal_tail: the candidates' q from the chain, the base marginal elsewhere
        (its [S, V] logits are used, as DFlash's proposal uses its own)."""
        candidates, table = self._table(out, anchor, output_embedding)
        return walk_chain_with_tail(table, candidates, out.logits[:, 0, 1:], sampling,
                                    self.chain_sampling(sampling), rng)

    def _vocabulary_chain(self, out, anchor, output_embedding, sampling, rng):
        """vocabulary_chain: each slot's refined state given the drawn predecessor, against
        every lm_head row (one [B, D] x [D, V] product per slot, in walk order)."""
        d = self.drafter

        def slot_logits(state, predecessor):                              # [B, D], [B]
            refined = d.refined_state(state, predecessor[:, None], output_embedding)[:, 0]
            return einsum_f32("BD,VD->BV", refined, output_embedding.astype(refined.dtype))

        return walk_vocabulary_chain(slot_logits, out.pre_injection[:, 0, 1:], anchor,
                                     self.chain_sampling(sampling), rng)

    def _dense(self, out, anchor, output_embedding, sampling, rng) -> Proposal:
        """`sampling`: the chain's own warp (`chain_sampling`)."""
        candidates, table = self._table(out, anchor, output_embedding)
        b, s, _ = candidates.shape
        tokens, _, q_c = walk_chain(table, candidates, sampling, rng)    # q_c [B, S, C]
        q = jnp.zeros((b, s, output_embedding.shape[0]), jnp.float32)
        q = q.at[jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None],
                 candidates].set(q_c)
        return Proposal(tokens=tokens, q=q)


def proposer_for(drafter, impl: str = "sparse",
                 kernel_implementation: str = DEFAULT_PROPOSAL_KERNEL):
    spine = drafter.config.dspine
    if spine is not None and spine.refinement_head:
        return ChainProposer(drafter, impl, kernel_implementation)
    kernel_call(kernel_implementation)  # refused here too: DFlash has no use for one
    return MarginalProposer(impl)
