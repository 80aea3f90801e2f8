"""Autoregressive generation with the target alone: one token per target pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspine_jax.attention import AttentionMetadata
from dspine_jax.decoding import BatchDecoder, DecodeState, emit, step_keys
from dspine_jax.kv_cache import PagedKVCache
from dspine_jax.sampling import sample_tokens

__all__ = ["AutoregressiveGenerator"]


class AutoregressiveGenerator(BatchDecoder):
    def create_caches(self, page_table, num_pages) -> tuple:
        return (PagedKVCache.create(self.config, page_table, num_pages,
                                    page_size=self.page_size, dtype=self.dtype),)

    def prefill(self, params, tokens, q_lens, caches):
        # right-padded chunks [B, T]: row b's first q_lens[b] tokens are real
        metadata = AttentionMetadata.paged(caches[0].lengths, caches[0].page_table,
                                           tokens.shape[1], q_lens=q_lens)
        out = self.target(params)(tokens, caches[0], metadata=metadata,
                                  attention=self.attention, layer_kernels=self.layer_kernels,
                                  logits_at=jnp.maximum(q_lens - 1, 0)[:, None])
        return out.logits[:, 0], (out.cache,)

    def step(self, params, state: DecodeState, sampling, ignore_eos,
             width: int | None = None) -> DecodeState:
        """One token per row; `width` (a speculative engine's verify width) is always 0."""
        cache = state.caches[0]
        out = self.target(params)(state.last_token[:, None], cache, attention=self.attention,
                                  layer_kernels=self.layer_kernels)
        with jax.named_scope("sample"):
            token = sample_tokens(out.logits[:, 0], sampling, step_keys(state))
        active = ~state.done
        lengths = jnp.where(active, out.cache.lengths, cache.lengths)  # finished rows stay
        state = state.replace(caches=(out.cache.replace(lengths=lengths),))
        return emit(state, token[:, None], jnp.ones_like(token), token, self.eos, ignore_eos)
