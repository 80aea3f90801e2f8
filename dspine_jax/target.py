"""Target language models (Qwen3 and Llama families) in Flax NNX.

One forward serves every use: full-sequence training features (no cache), batched ragged
prefill, single-token decode and multi-token verification (with a paged KV cache). It can
return the hidden states after chosen layers, which is what the drafters condition on.
Attention goes through an `AttentionBackend` under one `AttentionMetadata` per forward.

Shape legend:
  B batch, T new tokens, D hidden, N query heads, K kv heads, H head dim, P pages,
  PS page size, L layers picked for features, M logit positions, V vocab.
"""

from __future__ import annotations

import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dspine_jax.attention import AttentionBackend, AttentionMetadata, XlaBackend
from dspine_jax.config import TargetConfig
from dspine_jax.errors import ConfigError
from dspine_jax.fused_layers import FusedLayers, rope_rows
from dspine_jax.kv_cache import PagedKVCache
from dspine_jax.layers import MLP, Embedding, Linear, RMSNorm, split_sizes, stacked_linear
from dspine_jax.rope import apply_rope, rope_frequencies, rope_table
from pallas_kernels.ragged_paged_attention.common import split_packed
from pallas_kernels.rope import rotate_half_split


@struct.dataclass
class TargetOutput:
    logits: jax.Array | None          # [B, M, V] float32 (M = T unless logits_at is given)
    hidden_states: jax.Array | None   # [L, B, T, D] after the layers in hidden_layer_ids
    final_hidden: jax.Array           # [B, T, D] after the final norm (lm_head's input)
    cache: PagedKVCache | None

    def features(self) -> jax.Array:
        """The picked layers side by side, [B, T, L * D]: the drafters' feature input."""
        return jnp.concatenate(list(self.hidden_states), axis=-1)


# Decoders built in parallel threads on one model (e.g. compiled side by side) fuse it once.
FUSE_LOCK = threading.RLock()


def qkv_sizes(config: TargetConfig) -> tuple[int, int, int]:
    """The output widths of q, k and v: the rows of a fused qkv_proj, in that order."""
    return ((config.num_attention_heads * config.head_dim,)
            + (config.num_key_value_heads * config.head_dim,) * 2)


class Attention(nnx.Module):
    def __init__(self, config: TargetConfig, *, dtype, rngs: nnx.Rngs):
        d, h = config.hidden_size, config.head_dim
        n, k = config.num_attention_heads, config.num_key_value_heads
        bias = config.attention_bias
        self.config = config
        self.q_proj = Linear(d, n * h, bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, k * h, bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, k * h, bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(n * h, d, bias=bias, dtype=dtype, rngs=rngs)
        if config.qk_norm:
            self.q_norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype)

    @property
    def fused(self) -> bool:
        return hasattr(self, "qkv_proj")

    @property
    def _sizes(self) -> tuple[int, int, int]:
        return qkv_sizes(self.config)

    def fuse_projections(self) -> None:
        """For inference: q_proj, k_proj and v_proj become one qkv_proj ([q; k; v] rows
        stacked), one GEMM where there were three. Left apart, XLA's dot merger stacks the
        three weights into a new buffer on every call instead (on a GPU at 512 rows: 100 MB
        of traffic per Qwen3-8B layer and pass)."""
        if not self.fused:
            self.qkv_proj = stacked_linear(self.q_proj, self.k_proj, self.v_proj)
            del self.q_proj, self.k_proj, self.v_proj

    def qkv_weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The q, k and v weights [out, D], fused or not."""
        if self.fused:
            return tuple(split_sizes(self.qkv_proj.weight[...], self._sizes, axis=0))
        return self.q_proj.weight[...], self.k_proj.weight[...], self.v_proj.weight[...]

    def project(self, x: jax.Array, positions: jax.Array):
        """x [B, T, D] -> rotated q [B, T, N, H], rotated k and v [B, T, K, H]: the packed
        operand (`packed_qkv`) split and rotated, for attention outside the paged op."""
        q, k, v = split_packed(self.packed_qkv(x), self.config.num_key_value_heads)
        cos, sin = self.rotation(positions)
        return rotate_half_split(q, cos, sin), rotate_half_split(k, cos, sin), v

    def packed_qkv(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> [B, T, N + 2K, H]: each token's q heads, then its k and v heads,
        normed where the model norms them and not yet rotated: the attention's packed
        operand (`AttentionBackend.packed`), the fused projection's output as it lies
        where the model has no qk norms."""
        c = self.config
        n, k = c.num_attention_heads, c.num_key_value_heads
        if self.fused:
            qkv = self.qkv_proj(x)
        else:
            qkv = jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
        qkv = qkv.reshape(*x.shape[:2], n + 2 * k, c.head_dim)
        if c.qk_norm:
            qkv = jnp.concatenate([self.q_norm(qkv[:, :, :n]), self.k_norm(qkv[:, :, n:n + k]),
                                   qkv[:, :, n + k:]], axis=2)
        return qkv

    def rotation(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(cos, sin) [B, T, H/2] float32 of positions [B, T]: the RoPE of this layer."""
        return rope_table(positions, *rope_frequencies(self.config))

    def project_kv(self, x: jax.Array, positions: jax.Array):
        """Keys and values of x alone: how an unfused drafter turns target features into
        context KV (a fused drafter projects every layer's at once:
        `BlockDrafter.context_kvs`)."""
        return self.rotated_kv(self.k_proj(x), self.v_proj(x), positions)

    def rotated_kv(self, k: jax.Array, v: jax.Array, positions: jax.Array):
        """k, v [B, T, K * H] -> k (normed where the model does) rotated, v: [B, T, K, H]."""
        c = self.config
        k = k.reshape(*k.shape[:2], c.num_key_value_heads, c.head_dim)
        v = v.reshape(*v.shape[:2], c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k, positions, *rope_frequencies(c)), v

    def __call__(self, x, metadata: AttentionMetadata, attention: AttentionBackend,
                 pages=None):
        """With pages = (k_pages, v_pages) [P, PS, K, H], writes this call's k/v into the
        cache and attends over it; otherwise attends over the T new tokens.
        -> (out [B, T, D], the pages after the write or None)."""
        # the named scopes label the op groups of `profile_step`'s roofline table
        with jax.named_scope("qkv"):
            qkv = self.packed_qkv(x)
            rotation = self.rotation(metadata.positions)
        with jax.named_scope("attention"):
            out, pages = attention.packed(qkv, metadata, pages, rotation=rotation,
                                          num_kv_heads=self.config.num_key_value_heads)
        b, t = x.shape[:2]
        with jax.named_scope("o_proj"):
            return self.o_proj(out.reshape(b, t, -1)), pages


def unfused_tensors(tensors: dict, config: TargetConfig) -> dict:
    """Tensors by HF name with fused projections (`DecoderLayer.fuse_projections`) split
    back: `...qkv_proj.{weight,bias}` into q_proj/k_proj/v_proj, `...gate_up_proj.*` into
    gate_proj/up_proj, so a checkpoint has one layout whatever the model ran as."""
    out = {}
    for name, value in tensors.items():
        stem, _, leaf = name.rpartition(".")
        if stem.endswith("qkv_proj"):
            base = stem[: -len("qkv_proj")]
            parts = split_sizes(value, qkv_sizes(config), axis=0)
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[f"{base}{part}.{leaf}"] = rows
        elif stem.endswith("gate_up_proj"):
            base = stem[: -len("gate_up_proj")]
            gate, up = np.split(value, 2)
            out[f"{base}gate_proj.{leaf}"], out[f"{base}up_proj.{leaf}"] = gate, up
        else:
            out[name] = value
    return out


class DecoderLayer(nnx.Module):
    def __init__(self, config: TargetConfig, *, dtype, rngs: nnx.Rngs):
        self.self_attn = Attention(config, dtype=dtype, rngs=rngs)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias,
                       dtype=dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                                dtype=dtype)

    def fuse_projections(self) -> None:
        """q/k/v and gate/up as one GEMM each (`Attention.fuse_projections`)."""
        self.self_attn.fuse_projections()
        self.mlp.fuse_projections()

    def __call__(self, x, metadata, attention, pages=None):
        with jax.named_scope("norm"):
            h = self.input_layernorm(x)
        attn, pages = self.self_attn(h, metadata, attention, pages)
        x = x + attn
        with jax.named_scope("norm"):
            h = self.post_attention_layernorm(x)
        with jax.named_scope("mlp"):
            return x + self.mlp(h), pages

    def fused(self, x, metadata, attention, pages, kernels: FusedLayers, rotation):
        """The same layer through `kernels`' four ops (`dspine_jax.fused_layers`);
        rotation: the (cos, sin) [B * T, H/2] of metadata.positions (`rope_rows`)."""
        norm_qkv_rope, matmul_residual, norm_swiglu = kernels.ops()
        a, mlp, c = self.self_attn, self.mlp, self.self_attn.config
        b, t, d = x.shape
        rows = x.reshape(b * t, d)
        head_norms = (a.q_norm.weight[...], a.k_norm.weight[...]) if c.qk_norm else ()
        with jax.named_scope("qkv"):
            q, k, v = norm_qkv_rope(rows, self.input_layernorm.weight[...],
                                    *a.qkv_weights(), *rotation, *head_norms,
                                    eps=c.rms_norm_eps)
        heads = lambda y: y.reshape(b, t, -1, c.head_dim)  # noqa: E731
        with jax.named_scope("attention"):
            out, pages = attention(heads(q), heads(k), heads(v), metadata, pages)
        with jax.named_scope("o_proj"):
            rows = matmul_residual(out.reshape(b * t, -1), a.o_proj.weight[...], rows)
        with jax.named_scope("mlp"):
            act = norm_swiglu(rows, self.post_attention_layernorm.weight[...],
                              *mlp.gate_up_weights(), eps=c.rms_norm_eps)
            rows = matmul_residual(act, mlp.down_proj.weight[...], rows)
        return rows.reshape(b, t, d), pages


class TargetModel(nnx.Module):
    """A decoder-only LM. Attribute names mirror HF's (`model.` prefix dropped)."""

    def __init__(self, config: TargetConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype,
                                      rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, dtype=dtype, rngs=rngs)
                                for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.lm_head = (None if config.tie_word_embeddings else
                        Linear(config.hidden_size, config.vocab_size, dtype=dtype, rngs=rngs))

    def fuse_projections(self) -> None:
        """Prepare for inference, in place: every layer's q/k/v and gate/up projections as
        one GEMM each (`DecoderLayer.fuse_projections`). The forward is the same function
        of the same weights either way; `export_tensors` writes the unfused tensors."""
        with FUSE_LOCK:
            for layer in self.layers:
                layer.fuse_projections()

    # The two frozen tables the drafters share with the target.
    def input_embedding(self) -> jax.Array:
        """E_in [V, D]."""
        return self.embed_tokens.weight[...]

    def output_embedding(self) -> jax.Array:
        """E_out [V, D] (the lm_head rows; E_in itself when tied)."""
        return self.input_embedding() if self.lm_head is None else self.lm_head.weight[...]

    def compute_logits(self, final_hidden: jax.Array) -> jax.Array:
        """[..., D] after the final norm -> float32 logits [..., V]."""
        return jnp.einsum("...D,VD->...V", final_hidden, self.output_embedding(),
                          preferred_element_type=jnp.float32)

    def __call__(self, tokens: jax.Array, cache: PagedKVCache | None = None, *,
                 positions: jax.Array | None = None,
                 metadata: AttentionMetadata | None = None,
                 attention: AttentionBackend | None = None,
                 hidden_layer_ids: Sequence[int] = (),
                 logits_at: jax.Array | None = None,
                 return_logits: bool = True,
                 layer_kernels: FusedLayers | None = None) -> TargetOutput:
        """Forward T new tokens per row.

        tokens [B, T]. With a cache, row b's tokens sit at positions lengths[b] + (0..T-1),
        are written into its pages and attend causally over the cache; the returned cache
        has lengths + T (callers roll back rejected drafts). `metadata` overrides that
        (ragged prefill: only the first q_lens[b] tokens are real, and the returned
        lengths are metadata.kv_lens). Without a cache, positions default to 0..T-1 and
        attention is causal over the T tokens. `attention` defaults to dense XLA.
        `logits_at` [B, M] picks which positions get logits. `layer_kernels` runs the
        layers of paged calls of few rows through fused kernels (`FusedLayers`).
        """
        b, t = tokens.shape
        bad = [i for i in hidden_layer_ids if not 0 <= i < self.config.num_hidden_layers]
        if bad:
            raise ConfigError(f"hidden_layer_ids {bad} out of range for a "
                              f"{self.config.num_hidden_layers}-layer target")
        attention = XlaBackend() if attention is None else attention
        if metadata is None:
            if cache is not None:
                metadata = AttentionMetadata.paged(cache.lengths, cache.page_table, t)
            else:
                if positions is None:
                    positions = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
                metadata = AttentionMetadata.causal(positions)

        with jax.named_scope("embed"):
            x = self.embed_tokens(tokens)
        fused = layer_kernels is not None and layer_kernels.applies(b * t, metadata.is_paged)
        if fused:
            rotation = rope_rows(self.config, metadata.positions)
        picked, k_pages, v_pages = [], [], []
        for i, layer in enumerate(self.layers):
            pages = None if cache is None else (cache.k_pages[i], cache.v_pages[i])
            if fused:
                x, pages = layer.fused(x, metadata, attention, pages, layer_kernels, rotation)
            else:
                x, pages = layer(x, metadata, attention, pages)
            if cache is not None:
                k_pages.append(pages[0])
                v_pages.append(pages[1])
            if i in hidden_layer_ids:
                picked.append(x)
        hidden = None
        if hidden_layer_ids:
            order = sorted(hidden_layer_ids)
            hidden = jnp.stack([picked[order.index(i)] for i in hidden_layer_ids])

        with jax.named_scope("norm"):
            final = self.norm(x)
        logits = None
        if return_logits:
            with jax.named_scope("lm_head"):
                rows = final if logits_at is None else jnp.take_along_axis(
                    final, logits_at[..., None], axis=1)
                logits = self.compute_logits(rows)
        new_cache = None if cache is None else cache.replace(
            k_pages=tuple(k_pages), v_pages=tuple(v_pages), lengths=metadata.kv_lens)
        return TargetOutput(logits=logits, hidden_states=hidden, final_hidden=final,
                            cache=new_cache)
