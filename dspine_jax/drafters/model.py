"""Block drafters: DFlash, and DSpine (DFlash + adjacent injection + decoding head).

One layer stack serves both forwards:
  * training: every sampled block of a sequence in one pass; block j sees the context
    strictly before its anchor, itself (bidirectionally, or causally for DSpine), and no
    other block;
  * inference: one block per row against the drafter's context cache.
Both build the same queries and keys, so they give the same block logits. Training is a
dense call with a block-diagonal mask; inference is a paged call whose block is written
past the context's length (never kept: the length does not advance) and attended with
the causal mask (DSpine) or bidirectionally (DFlash).

The target's frozen tables (input embedding E_in, output embedding E_out) are arguments,
never parameters: gradients cannot reach them and checkpoints hold only the drafter.

Shape legend:
  B batch, T sequence (context) length, S context capacity, n blocks per row, K block
  size (slots), D hidden, F fused feature input (features x D), L draft layers,
  r transfer rank, V vocab, C candidates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dspine_jax.attention import AttentionBackend, AttentionMetadata, XlaBackend
from dspine_jax.drafters.blocks import predecessor_tokens, training_mask
from dspine_jax.drafters.config import DrafterConfig
from dspine_jax.drafters.injection import Injection
from dspine_jax.drafters.transfer import (TransferSpace, build_transfer_space, code_table,
                                          transfer_codes)
from dspine_jax.kv_cache import PagedKVCache
from dspine_jax.layers import Linear, RMSNorm, einsum_f32, stacked_linear
from dspine_jax.target import FUSE_LOCK, DecoderLayer


class TransferBasis(nnx.Variable):
    """The fixed transfer space, saved with the drafter and never trained: the whitening
    map (codes computed from the target's lm_head rows on demand, so a checkpoint holds
    [H, r] numbers) or, for a drafter read from the reference layout, the [V, r] code
    table itself."""


@struct.dataclass
class DraftOutput:
    logits: jax.Array | None          # [B, n, K, V] float32 base logits (slot 0 unused);
                                      # None when not asked for (a fused training loss)
    hidden: jax.Array                 # [B, n, K, D] after the final norm
    pre_injection: jax.Array | None   # [B, n, K, D] last layer, before its injection (DSpine)
    features: jax.Array | None        # [L, B, n, K, r] phi_l after each injection (DSpine)
    gates: jax.Array | None           # [L] mean gate value per layer (DSpine)
    # [L, B, n, K, D] each layer's output (after its injection), before the final norm:
    # only when asked for (a logit lens in diagnostics)
    layers: jax.Array | None = None
    # inference: the context cache with this block's keys/values written past its
    # length (lengths unchanged); carry it on so the pools are updated in place
    context: PagedKVCache | None = None


class DrafterLayer(DecoderLayer):
    """A Qwen3 decoder layer whose keys/values are [context features ; block]."""

    def context_kv(self, fused: jax.Array, positions: jax.Array):
        """KV injection: context features [B, S, D] bypass the norm, Q, O and MLP."""
        return self.self_attn.project_kv(fused, positions)

    def draft(self, x, metadata: AttentionMetadata, attention: AttentionBackend, ctx):
        """x [B, Q, D] block hiddens at metadata.positions.

        Paged metadata: ctx = this layer's context (k_pages, v_pages); the block's k/v are
        written past the context and attended with it. Dense: ctx = context (k, v)
        [B, S, K, H], keys are [context ; block] under metadata.dense_mask [B, Q, S + Q].
        -> (x, ctx after the write)."""
        h = self.input_layernorm(x)
        if metadata.is_paged:
            a = self.self_attn
            out, ctx = attention.packed(a.packed_qkv(h), metadata, ctx,
                                        rotation=a.rotation(metadata.positions),
                                        num_kv_heads=a.config.num_key_value_heads)
        else:
            q, k, v = self.self_attn.project(h, metadata.positions)
            ctx_k, ctx_v = ctx
            out, _ = attention(q, jnp.concatenate([ctx_k, k.astype(ctx_k.dtype)], 1),
                               jnp.concatenate([ctx_v, v.astype(ctx_v.dtype)], 1), metadata)
        x = x + self.self_attn.o_proj(out.reshape(*x.shape[:2], -1))
        return x + self.mlp(self.post_attention_layernorm(x)), ctx


class BlockDrafter(nnx.Module):
    """A DFlash or DSpine drafter. A DSpine drafter holds its transfer space as the
    whitening map (`transfer_whiten` [D, r], `transfer_mean` [D]; what training builds) or,
    with `code_table=True`, as the code table `transfer_codes` [V, r] (what the reference
    layout stores). Both give the same codes: the table is the map applied to every row
    of the target's lm_head."""

    def __init__(self, config: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 transfer: TransferSpace | None = None, code_table: bool = False):
        self.config = config
        self.dtype = dtype
        d = config.hidden_size
        layer_config = config.layer_config()
        self.fc = Linear(config.num_features * d, d, dtype=dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([DrafterLayer(layer_config, dtype=dtype, rngs=rngs)
                                for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype)
        spine = config.dspine
        if spine is not None:
            self.injection = Injection(d, spine.transfer_rank, spine.message_size,
                                       config.num_hidden_layers, dtype=dtype, rngs=rngs)
            # float32 whatever the compute dtype: codes are unit vectors of a whitened map.
            if code_table:
                if transfer is not None:
                    raise ValueError("a drafter holds its transfer space as the whitening "
                                     "map or as the code table, not both")
                self.transfer_codes = TransferBasis(
                    jnp.zeros((config.vocab_size, spine.transfer_rank)))
            else:
                self.transfer_whiten = TransferBasis(jnp.zeros((d, spine.transfer_rank)))
                self.transfer_mean = TransferBasis(jnp.zeros((d,)))
                if transfer is not None:
                    self.set_transfer_space(transfer)

    def fuse_projections(self) -> None:
        """Prepare for inference, in place: every layer's q/k/v and gate/up projections as
        one GEMM each (`DecoderLayer.fuse_projections`), and the context's k/v of all
        layers as one GEMM (`context_kv_proj`, [L * 2 * K * H, D]: a copy of the layers'
        k/v rows, since the block's own q/k/v stay one GEMM per layer). Apart, XLA stacks
        the layers' k/v weights into a new buffer on every call. `save_drafter` writes the
        unfused tensors and not the copy: a fused drafter is for decoding, not training."""
        with FUSE_LOCK:
            if not hasattr(self, "context_kv_proj"):
                self.context_kv_proj = stacked_linear(*(
                    proj for layer in self.layers
                    for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj)))
            for layer in self.layers:
                layer.fuse_projections()

    def context_kvs(self, fused: jax.Array, positions: jax.Array) -> list:
        """KV injection: each layer's context (k, v) [B, T, K, H] from the fused features
        [B, T, D] (bypassing the norm, Q, O and the MLP), one GEMM for all layers once
        fused."""
        if not hasattr(self, "context_kv_proj"):
            return [layer.context_kv(fused, positions) for layer in self.layers]
        kvs = jnp.split(self.context_kv_proj(fused), 2 * len(self.layers), axis=-1)
        return [layer.self_attn.rotated_kv(k, v, positions)
                for layer, k, v in zip(self.layers, kvs[0::2], kvs[1::2])]

    def set_transfer_space(self, space: TransferSpace) -> None:
        """Install the whitening map and initialise every readout R_l to D^T."""
        self.transfer_whiten[...] = jnp.asarray(space.whiten, jnp.float32)
        self.transfer_mean[...] = jnp.asarray(space.mean, jnp.float32)
        for readout in self.injection.readouts:
            readout.weight[...] = jnp.asarray(space.projection, self.dtype)

    @classmethod
    def create(cls, config: DrafterConfig, output_embedding=None, *, seed: int = 0,
               dtype=jnp.float32) -> "BlockDrafter":
        """A fresh drafter; DSpine builds its transfer space from E_out [V, D]."""
        transfer = None
        if config.dspine is not None:
            if output_embedding is None:
                raise ValueError("a DSpine drafter needs the target's output embedding")
            transfer = build_transfer_space(output_embedding, config.dspine.transfer_rank)
        return cls(config, dtype=dtype, rngs=nnx.Rngs(seed), transfer=transfer)

    # ----- shared pieces ---------------------------------------------------------------------
    @property
    def injecting(self) -> bool:
        return self.config.injecting

    def fuse(self, features: jax.Array) -> jax.Array:
        """Concatenated target features [B, T, F] -> [B, T, D]."""
        return self.hidden_norm(self.fc(features.astype(self.dtype)))

    @property
    def has_code_table(self) -> bool:
        """The transfer space is held as the [V, r] table (else as the whitening map)."""
        return hasattr(self, "transfer_codes")

    def code(self, tokens: jax.Array, output_embedding: jax.Array) -> jax.Array:
        """sqrt(r) * c_token [..., r] float32: a token placed in the transfer space, from
        its lm_head row (E_out [V, D]) exactly as build_transfer_space defines c, or its
        row of the code table."""
        if self.has_code_table:
            codes = jnp.take(self.transfer_codes[...], tokens, axis=0)
        else:
            codes = transfer_codes(jnp.take(output_embedding, tokens, axis=0),
                                   self.transfer_mean[...], self.transfer_whiten[...])
        return jnp.sqrt(self.config.dspine.transfer_rank) * codes

    def code_table(self, output_embedding) -> np.ndarray:
        """All V codes c_v [V, r] float32 (the reference's `transfer_codes` table)."""
        if self.has_code_table:
            return np.asarray(self.transfer_codes[...], np.float32)
        return code_table(output_embedding, self.transfer_mean[...], self.transfer_whiten[...])

    def _block_inputs(self, anchor_tokens: jax.Array, input_embedding: jax.Array,
                      positions: int | None = None):
        """[anchor, MASK, ..., MASK] per block (its first `positions`, default all K),
        embedded with the frozen E_in: [B, n, K, D]."""
        k = positions or self.config.block_size
        tokens = jnp.concatenate([anchor_tokens[..., None], jnp.full(
            anchor_tokens.shape + (k - 1,), self.config.mask_token_id, anchor_tokens.dtype)], -1)
        return jnp.take(input_embedding, tokens, axis=0).astype(self.dtype)

    @property
    def block_mask(self) -> str:
        """The mask of a block after its context: DSpine causal, DFlash bidirectional."""
        return "causal_block" if self.config.causal_block else "bidirectional_block"

    def _run(self, x, metadata, attention, ctx, anchor_tokens, output_embedding,
             teacher_tokens=None, replace=None, replace_layers=0, with_logits=True,
             keep_layers=False):
        """The layer stack. x [B, n, K, D]; metadata for the n*K block queries; ctx: per
        layer the context (pages, or dense (k, v)).

        teacher_tokens [B, n, K]: the true predecessor of each slot (training only);
        replace [B, n] bool: blocks whose first `replace_layers` layers take those instead
        of predictions; keep_layers: return every layer's output too.
        -> (DraftOutput, per layer ctx after the call)."""
        b, n, k, d = x.shape
        h = x
        pre_injection, features, gates, new_ctx, layers = None, [], [], [], []
        for i, layer in enumerate(self.layers):
            h, layer_ctx = layer.draft(h.reshape(b, n * k, d), metadata, attention, ctx[i])
            new_ctx.append(layer_ctx)
            h = h.reshape(b, n, k, d)
            if self.config.dspine is not None:
                pre_injection = h
                if self.injecting:
                    h, gate = self._inject(i, h, anchor_tokens, output_embedding,
                                           teacher_tokens if i < replace_layers else None,
                                           replace)
                    gates.append(jnp.mean(gate[:, :, 1:]))
                features.append(self.injection.feature(i, h))
            if keep_layers:
                layers.append(h)
        final = self.norm(h)
        logits = (einsum_f32("BnKD,VD->BnKV", final, output_embedding.astype(final.dtype))
                  if with_logits else None)
        return DraftOutput(
            logits=logits, hidden=final, pre_injection=pre_injection,
            features=jnp.stack(features) if features else None,
            gates=jnp.stack(gates) if gates else None,
            layers=jnp.stack(layers) if layers else None), new_ctx

    def _inject(self, layer, h, anchor_tokens, output_embedding, teacher_tokens, replace):
        """Gated adjacent injection after `layer` for slots 1..K-1 of every block."""
        phi = self.injection.feature(layer, h)                      # [B, n, K, r]
        anchor = self.code(anchor_tokens, output_embedding)[:, :, None]  # [B, n, 1, r]
        # p_1 = the anchor's code, p_i = phi(h_{i-1}) for i >= 2 (slot 0 gets no write).
        pred = jnp.concatenate([anchor, anchor, phi[:, :, 1:-1]], axis=2)
        if teacher_tokens is not None and replace is not None:
            pred = jnp.where(replace[:, :, None, None],
                             self.code(teacher_tokens, output_embedding), pred)
        delta, gate = self.injection.write(layer, h, phi, pred)
        not_anchor = (jnp.arange(h.shape[2]) > 0)[None, None, :, None]
        return h + jnp.where(not_anchor, delta, 0), gate

    # ----- training ---------------------------------------------------------------------------
    def forward_train(self, tokens, features, anchors, input_embedding, output_embedding,
                      *, replace=None, replace_layers=0,
                      attention: AttentionBackend | None = None,
                      logits: bool = True, keep_layers: bool = False) -> DraftOutput:
        """All blocks of each sequence in one pass.

        tokens [B, T]; features [B, T, F] target features at every position; anchors
        [B, n] block start positions. Block j covers anchors[j] .. anchors[j] + K - 1 and
        sees context positions < anchors[j]. logits=False leaves out the [B, n, K, V]
        logits (a loss that reads only the final hidden states); keep_layers=True returns
        every layer's output too (`DraftOutput.layers`, a logit lens)."""
        b, t = tokens.shape
        k = self.config.block_size
        fused = self.fuse(features)
        ctx_positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        ctx_kv = self.context_kvs(fused, ctx_positions)
        anchor_tokens = jnp.take_along_axis(tokens, anchors, axis=1)
        positions = anchors[..., None] + jnp.arange(k)
        ctx_visible = jnp.arange(t)[None, None, :] < anchors[..., None]
        n = anchors.shape[1]
        mask = training_mask(ctx_visible, k, self.config.causal_block)
        metadata = AttentionMetadata.dense(positions.reshape(b, n * k), mask, "block_diagonal")
        out, _ = self._run(self._block_inputs(anchor_tokens, input_embedding), metadata,
                           attention or XlaBackend(), ctx_kv, anchor_tokens,
                           output_embedding,
                           teacher_tokens=predecessor_tokens(tokens, anchors, k),
                           replace=replace, replace_layers=replace_layers,
                           with_logits=logits, keep_layers=keep_layers)
        return out

    # ----- inference --------------------------------------------------------------------------
    def create_context(self, batch_size: int, capacity: int) -> PagedKVCache:
        """A context cache of its own (row b owns pages b * PPS ..): tests, one-off use.
        The engine builds the context over the target's page table instead."""
        return PagedKVCache.contiguous(self.config.layer_config(), batch_size, capacity,
                                       self.dtype)

    def extend_context(self, context: PagedKVCache, features: jax.Array,
                       num_new: jax.Array,
                       attention: AttentionBackend | None = None) -> PagedKVCache:
        """Append target features [B, T, F] at each row's end; only the first num_new [B]
        are written and counted."""
        attention = attention or XlaBackend()
        fused = self.fuse(features)
        metadata = AttentionMetadata.paged(context.lengths, context.page_table,
                                           features.shape[1], q_lens=num_new)
        k_pages, v_pages = [], []
        for i, (k, v) in enumerate(self.context_kvs(fused, metadata.positions)):
            kp, vp = attention.write(k, v, metadata, (context.k_pages[i], context.v_pages[i]))
            k_pages.append(kp)
            v_pages.append(vp)
        return context.replace(k_pages=tuple(k_pages), v_pages=tuple(v_pages),
                               lengths=metadata.kv_lens)

    def draft_block(self, anchor_tokens: jax.Array, context: PagedKVCache, input_embedding,
                    output_embedding, attention: AttentionBackend | None = None,
                    positions: int | None = None) -> DraftOutput:
        """One block per row: the anchor [B] sits at position context.lengths (the context
        holds features for every earlier position). The block's K keys are written at
        lengths .. lengths + K - 1 (the pages must reach that far) and not kept: the
        returned `context` has the same lengths. Returns [B, 1, K, ...] outputs.

        positions: draft only the block's first `positions` (a verify narrower than the
        block needs no more). Only a causal block (DSpine) allows it: its first positions
        see no later one, so their outputs are those of the whole block; a bidirectional
        block's every position sees all the others."""
        k = self.config.block_size
        if positions is not None and positions != k:
            if not 2 <= positions <= k:      # the anchor and at least one draft
                raise ValueError(f"positions must be in [2, {k}], got {positions}")
            if not self.config.causal_block:
                raise ValueError("only a causal block (DSpine) can be drafted in part: "
                                 "every position of a bidirectional block sees the others")
            k = positions
        metadata = AttentionMetadata.paged(context.lengths, context.page_table, k,
                                           mask=self.block_mask)
        ctx = list(zip(context.k_pages, context.v_pages))
        out, ctx = self._run(self._block_inputs(anchor_tokens[:, None], input_embedding, k),
                             metadata, attention or XlaBackend(), ctx,
                             anchor_tokens[:, None], output_embedding)
        written = context.replace(k_pages=tuple(p[0] for p in ctx),
                                  v_pages=tuple(p[1] for p in ctx))
        return out.replace(context=written)

    def proposer(self, impl: str = "sparse", kernel_implementation: str | None = None):
        """What turns this drafter's pass into draft tokens and their q
        (`dspine_jax/drafters/proposers.py`): impl "sparse" (q only where it is nonzero, no
        [S, V] tensor) or "dense" (the original [B, S, V] q)."""
        from dspine_jax.drafters import DEFAULT_PROPOSAL_KERNEL
        from dspine_jax.drafters.proposers import proposer_for

        return proposer_for(self, impl, kernel_implementation or DEFAULT_PROPOSAL_KERNEL)

    # ----- DSpine's decoding head (design doc 2.5) ---------------------------------------------
    def transition_scores(self, pre_injection: jax.Array, predecessors: jax.Array,
                          candidate_rows: jax.Array, output_embedding: jax.Array) -> jax.Array:
        """Scores of successor candidates given each predecessor token.

        pre_injection [..., D] (the transition cache); predecessors [..., P] token ids;
        candidate_rows [..., C, D] lm_head rows of the candidates; output_embedding
        E_out [V, D] -> [..., P, C] float32.
        Redoes the last layer's write with p = sqrt(r) c_a, then the final norm."""
        refined = self.refined_state(pre_injection, predecessors, output_embedding)
        return einsum_f32("...PD,...CD->...PC", refined, candidate_rows.astype(refined.dtype))

    def refined_state(self, pre_injection: jax.Array, predecessors: jax.Array,
                      output_embedding: jax.Array) -> jax.Array:
        """The slot's final state given each predecessor token: pre_injection [..., D],
        predecessors [..., P] -> [..., P, D] (E_out @ it: the head's logits over the whole
        vocabulary, which diagnostics compare with the C-candidate restriction)."""
        last = self.config.num_hidden_layers - 1
        phi = self.injection.feature(last, pre_injection)[..., None, :]   # [..., 1, r]
        h = pre_injection[..., None, :]                                    # [..., 1, D]
        delta, _ = self.injection.write(last, h, phi, self.code(predecessors, output_embedding))
        return self.norm(h + delta)                                        # [..., P, D]
