"""Speculative decoding with a DFlash or DSpine drafter: lossless, batched, compiled once.

Invariant between steps, per row: the target cache and the drafter context hold
positions 0 .. L-1; the anchor (the last emitted token) sits at position L. Both caches
are paged over one page table (the context follows the target's pages), each row's pages
reaching L + K for every L the row can reach.
One step = three separable stages:
  draft   one drafter pass over [anchor, MASK...] -> K-1 draft tokens and their q; the
          block's keys go into the context's pages at L .. L + K - 1, its length stays L
  verify  one target pass over [anchor, drafts] -> p at every position, target features;
          the block's keys go into the target's pages at L .. L + K - 1
  accept  the verification rule keeps n drafts and adds one target token; the target
          cache rolls back to L + n + 1, the drafter context gains the features of
          positions L .. L + n (over the draft's entries), and the target's token
          becomes the next anchor.
Rows advance by different amounts; finished rows are frozen.

A step verifies the first `width` drafts only (`speculative/policy.py` picks the width
per call; the verification rule on a prefix of the block is the same rule, so every width
is exact). Width 0 is a plain AR step: no drafter pass, the target samples the next token,
the context still gains the anchor's features.

Shape legend: B batch, K block size, V vocab, F fused feature width.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dspine_jax import row_keys
from dspine_jax.decoding import BatchDecoder, DecodeState, emit, step_keys
from dspine_jax.drafters import DEFAULT_PROPOSAL, DEFAULT_PROPOSAL_KERNEL
from dspine_jax.drafters.model import BlockDrafter
from dspine_jax.attention import AttentionMetadata
from dspine_jax.kv_cache import PagedKVCache
from dspine_jax.registry import cache_dir
from dspine_jax.sampling import sample_tokens, target_probabilities
from dspine_jax.speculative.policy import SpeculationConfig, SpeculationPolicy
from dspine_jax.speculative.propose import Proposal, proposal_prefix
from dspine_jax.speculative.verify import Verdict, verify, verify_logits
from dspine_jax.target import TargetModel


def speculation_folder() -> Path:
    """Where engines keep the speculation policy's measured costs and acceptance."""
    return cache_dir() / "speculation"


class SpeculativeEngine(BatchDecoder):
    def __init__(self, target: TargetModel, drafter: BlockDrafter, *,
                 eos_token_ids: Sequence[int] = (), steps_per_call: int = 4,
                 proposal_impl: str = DEFAULT_PROPOSAL,
                 proposal_kernel: str = DEFAULT_PROPOSAL_KERNEL,
                 speculation: SpeculationConfig = SpeculationConfig("fixed"), **options):
        """options: BatchDecoder's (shared_steps_per_call, attention_backend, page_size,
        switches).
        proposal_impl: "sparse" (q and p only where needed, no [K, V] warp) or "dense"
        (the original [B, K, V] p and q, kept for comparison). proposal_kernel: the
        `vocab_top_k` implementation of DSpine's sparse proposal ("xla", "auto", "pallas",
        or vocab_top_k's "pallas_gpu", "pallas_tpu"; see `proposers.kernel_call`); "xla"
        until the Pallas kernels have run on hardware. speculation: how many drafts each
        pass verifies (`SpeculationConfig`: adaptive, fixed or off); the engine alone
        verifies the whole block (fixed), `Pipeline` and the CLI default to adaptive."""
        drafter.config.check_target(target.config)
        speculation.validate(drafter.config.block_size)
        # refuses an unknown name now, not at trace time
        drafter.proposer(proposal_impl, proposal_kernel)
        self.proposal_impl = proposal_impl
        self.proposal_kernel = proposal_kernel
        self.drafter_config = drafter.config
        super().__init__(target, eos_token_ids=eos_token_ids, steps_per_call=steps_per_call,
                         **options)
        self.block_size = drafter.config.block_size
        self.extra_capacity = self.block_size  # verify writes a whole block past the anchor
        self.layer_ids = tuple(drafter.config.target_layer_ids)
        drafter.fuse_projections()   # in place, as the target's (BatchDecoder)
        self.drafter_graph, self.drafter_params = nnx.split(drafter)
        self.speculation = speculation
        self.widths = speculation.widths(self.block_size)
        # kept for the decoder's life (and in a file between processes): the costs it
        # measures hold for every later batch on this device
        self.policy = SpeculationPolicy(speculation, self.block_size)
        if len(self.widths) > 1:
            self.policy.load(self.policy_file())

    def default_width(self) -> int:
        return self.widths[-1]

    def speculation_policy(self):
        return self.policy if len(self.widths) > 1 else None

    def policy_file(self) -> Path:
        """Where this device's costs for this target, drafter and engine are kept: a name
        hashed from everything a pass's time depends on."""
        device = jax.devices()[0]
        key = repr((device.platform, device.device_kind, self.config, self.drafter_config,
                    str(self.dtype), type(self.attention).__name__, self.proposal_impl,
                    self.proposal_kernel, self.steps_per_call, self.page_size, self.widths))
        name = hashlib.sha256(key.encode()).hexdigest()[:20]
        return speculation_folder() / f"{name}.json"

    def finished_batch(self) -> None:
        if self.speculation_policy() is not None:
            try:
                self.policy.save(self.policy_file())
            except OSError:       # a read-only cache costs the next process a measurement
                pass

    def params(self) -> tuple:
        return (self.target_params, self.drafter_params)

    def drafter(self, params) -> BlockDrafter:
        return nnx.merge(self.drafter_graph, params[1])

    def attention_configs(self, target) -> list:
        return [target.config, self.drafter_config.layer_config()]

    def create_caches(self, page_table, num_pages) -> tuple:
        def cache(config):
            return PagedKVCache.create(config, page_table, num_pages, page_size=self.page_size,
                                       dtype=self.dtype)
        return (cache(self.config), cache(self.drafter_config.layer_config()))

    def prefill(self, params, tokens, q_lens, caches):
        target_cache, context = caches
        # right-padded chunks [B, T]: row b's first q_lens[b] tokens are real; both caches
        # grow by them (the context by their target features)
        metadata = AttentionMetadata.paged(target_cache.lengths, target_cache.page_table,
                                           tokens.shape[1], q_lens=q_lens)
        out = self.target(params)(tokens, target_cache, metadata=metadata,
                                  attention=self.attention, hidden_layer_ids=self.layer_ids,
                                  layer_kernels=self.layer_kernels,
                                  logits_at=jnp.maximum(q_lens - 1, 0)[:, None])
        context = self.drafter(params).extend_context(context, out.features(), q_lens,
                                                      attention=self.attention)
        return out.logits[:, 0], (out.cache, context)

    # ----- the three stages ------------------------------------------------------------------
    def draft(self, params, state: DecodeState, sampling, rng,
              width: int | None = None) -> tuple[Proposal, DecodeState]:
        """-> the proposal of `width` drafts (default: the whole block), and the state
        whose context pages hold the block's keys. A causal block (DSpine) is drafted only
        as far as the verify reaches (its first width + 1 positions are the same either
        way): a narrower verify saves the draft's and the proposal's work too, not only
        the target's. A bidirectional block (DFlash) is drafted whole and cut."""
        drafter, target = self.drafter(params), self.target(params)
        e_out = target.output_embedding()
        positions = None if width is None or not self.drafter_config.causal_block \
            else width + 1
        with jax.named_scope("draft"):
            out = drafter.draft_block(state.last_token, state.caches[1],
                                      target.input_embedding(), e_out, attention=self.attention,
                                      positions=positions)
        state = state.replace(caches=(state.caches[0], out.context))
        with jax.named_scope("proposal"):
            proposal = drafter.proposer(self.proposal_impl, self.proposal_kernel).propose(
                out, state.last_token, e_out, sampling, rng)
        return proposal, state

    def verify(self, params, state: DecodeState, proposal: Proposal, sampling, rng):
        block = jnp.concatenate([state.last_token[:, None], proposal.tokens], axis=1)
        out = self.target(params)(block, state.caches[0], attention=self.attention,
                                  hidden_layer_ids=self.layer_ids,
                                  layer_kernels=self.layer_kernels)
        with jax.named_scope("accept"):
            if self.proposal_impl == "dense":
                p = target_probabilities(out.logits, sampling)
                return verify(proposal.tokens, proposal.dense_q(), p, rng), out
            return verify_logits(proposal, out.logits, sampling, rng), out

    def plain_step(self, params, state: DecodeState, sampling, rng):
        """Width 0: the target alone on the anchor, its token sampled as AR samples it."""
        out = self.target(params)(state.last_token[:, None], state.caches[0],
                                  attention=self.attention, hidden_layer_ids=self.layer_ids,
                                  layer_kernels=self.layer_kernels)
        with jax.named_scope("sample"):
            token = sample_tokens(out.logits[:, 0], sampling, rng)
        b = token.shape[0]
        proposal = Proposal(tokens=jnp.zeros((b, 0), jnp.int32),
                            q=jnp.zeros((b, 0, 1), jnp.float32))
        return proposal, Verdict(num_accepted=jnp.zeros((b,), jnp.int32), next_token=token), out

    def accept(self, params, state: DecodeState, proposal: Proposal, verdict: Verdict,
               target_out, ignore_eos) -> DecodeState:
        target_cache, context = state.caches
        active = ~state.done
        n = verdict.num_accepted
        kept = jnp.where(active, n + 1, 0)             # anchor + accepted drafts enter caches
        target_cache = target_out.cache.replace(lengths=target_cache.lengths + kept)
        with jax.named_scope("draft"):      # the drafter's context KV of the kept tokens
            context = self.drafter(params).extend_context(
                context, target_out.features(), kept, attention=self.attention)
        # Emitted: the accepted drafts, then the target's token.
        with jax.named_scope("accept"):
            tokens = jnp.concatenate([proposal.tokens, jnp.zeros_like(n)[:, None]], 1)
            tokens = tokens.at[jnp.arange(tokens.shape[0]), n].set(verdict.next_token)
            state = state.replace(caches=(target_cache, context))
            return emit(state, tokens, n + 1, verdict.next_token, self.eos, ignore_eos)

    def step(self, params, state: DecodeState, sampling, ignore_eos,
             width: int | None = None) -> DecodeState:
        """One pass verifying the first `width` drafts (default: this engine's widest)."""
        width = self.default_width() if width is None else width
        draft_key, verify_key = row_keys.split(step_keys(state), 2)    # [B] keys each
        if width == 0:
            proposal, verdict, target_out = self.plain_step(params, state, sampling, verify_key)
        else:
            proposal, state = self.draft(params, state, sampling, draft_key, width)
            proposal = proposal_prefix(proposal, width)
            verdict, target_out = self.verify(params, state, proposal, sampling, verify_key)
        return self.accept(params, state, proposal, verdict, target_out, ignore_eos)
