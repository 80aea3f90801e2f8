"""Attention backends: one interface for every attention call of the target and drafters.

  backend(q, k, v, metadata, pages) -> (out, pages)

Paged calls (metadata.is_paged) write this call's k/v into `pages` = (k_pages, v_pages) of
one layer and attend over the cache; dense calls attend over the k/v given, under
metadata.dense_mask, and return pages unchanged (None). `backend.write` only writes (the
drafter's context grows by target features, with no attention).

  xla     dense XLA attention (`layers.dot_product_attention`): paged calls gather the
          rows' pages into a [B, S, K, H] view first, so they cost O(capacity) per row.
          Differentiable; the only path for dense calls (training), on every backend.
  pallas  the `pallas_kernels.ragged_paged_attention` op for paged calls: reads only each
          row's first kv_len keys. Compiled on CUDA GPUs, and on TPUs (the Mosaic kernel,
          lowered in CI, never yet run on one); on other platforms it runs the GPU kernel
          in Pallas interpret mode (slow; for tests). `PallasBackend("pallas_tpu",
          interpret=False)` asks for the TPU kernel from any host (to lower for TPU).
  cudnn   dense calls through cuDNN's fused (flash) attention, which never writes the
          [B, N, T, S] scores: training's frozen target (plain causal; `target.attention`)
          and drafter (its packed blocks' mask as an additive bias; `drafter.attention`).
          CUDA GPUs, bf16/f16; paged calls as xla.

Shape legend: B batch, T query tokens, S keys, N query heads, K kv heads, H head dim,
P pages, PS page size.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from dspine_jax.attention.metadata import AttentionMetadata
from dspine_jax.errors import ConfigError
from dspine_jax.kv_cache import gather_pages, write_pages
from dspine_jax.layers import dot_product_attention
from pallas_kernels.ragged_paged_attention.common import rotate_qk, split_packed

BACKENDS = ("auto", "pallas", "xla")


class AttentionBackend:
    name = "?"

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, metadata: AttentionMetadata,
                 pages: tuple[jax.Array, jax.Array] | None = None):
        """q [B, T, N, H]; paged: k/v [B, T, K, H] this call's tokens, pages the layer's
        (k_pages, v_pages) [P, PS, K, H]; dense: k/v [B, S, K, H] every key.
        -> (out [B, T, N, H], the pages with the new tokens written, or None)."""
        if metadata.is_paged:
            return self.paged(q, k, v, metadata, pages)
        return dot_product_attention(q, k, v, metadata.dense_mask), None

    def packed(self, qkv: jax.Array, metadata: AttentionMetadata, pages=None, *,
               rotation: tuple[jax.Array, jax.Array], num_kv_heads: int):
        """As __call__ with q, k and v packed and not yet rotated: qkv [B, T, N + 2K, H],
        each token's N query heads, then its K keys, then its K values
        (`Attention.packed_qkv`); rotation (cos, sin) [B, T, H/2] float32, the RoPE of
        metadata.positions. Here one XLA fusion rotates q and k and splits the three."""
        qkv, _, _ = rotate_qk(qkv, None, None, rotation, num_kv_heads)
        return self(*split_packed(qkv, num_kv_heads), metadata, pages)

    def paged(self, q, k, v, metadata, pages):
        raise NotImplementedError

    def write(self, k: jax.Array, v: jax.Array, metadata: AttentionMetadata, pages):
        """Write this call's k/v [B, T, K, H] (the first q_lens of each row) into pages."""
        valid = metadata.write_mask
        return tuple(write_pages(p, x, metadata.page_table, metadata.positions, valid)
                     for p, x in zip(pages, (k, v)))

    def check(self, *, head_dim: int, num_heads: int, num_kv_heads: int, dtype,
              page_size: int) -> str | None:
        """Why this backend cannot run a model of these shapes (None: it can)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class XlaBackend(AttentionBackend):
    name = "xla"

    def paged(self, q, k, v, metadata, pages):
        k_pages, v_pages = self.write(k, v, metadata, pages)
        # [B, S, K, H] the rows' pages in order; positions >= kv_len are zeroed, so what
        # unused pages hold (NaN in tests) cannot reach the output through 0 * NaN.
        keys = gather_pages(k_pages, metadata.page_table)
        values = gather_pages(v_pages, metadata.page_table)
        s = keys.shape[1]
        valid = (jnp.arange(s)[None, :] < metadata.kv_lens[:, None])[:, :, None, None]
        keys, values = jnp.where(valid, keys, 0), jnp.where(valid, values, 0)
        out = dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype),
                                    metadata.paged_mask(s))
        return out, (k_pages, v_pages)


class CudnnBackend(XlaBackend):
    """Dense calls through `jax.nn.dot_product_attention(implementation="cudnn")`.

    A plain causal mask over the tokens' order (T queries over the same T keys, positions
    0..T-1 or any right-padded prefix of them, as in the training target's forward) is
    cuDNN's own causal mask; any other dense mask [B, T, S] (the drafter's packed blocks
    in training) goes in as an additive bias, which every query row must leave a key
    (the blocks' always do: each slot sees itself). Paged calls go the XLA way.
    `implementation` is a field so the CPU tests can check this call's layout and masking
    through jax.nn's XLA path."""
    name = "cudnn"

    def __init__(self, implementation: str = "cudnn"):
        self.implementation = implementation

    def __call__(self, q, k, v, metadata, pages=None):
        if metadata.is_paged:
            return super().__call__(q, k, v, metadata, pages)
        if metadata.mask == "causal" and q.shape[1] == k.shape[1]:
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                               implementation=self.implementation)
        else:
            out = jax.nn.dot_product_attention(q, k, v, mask=metadata.dense_mask[:, None],
                                               implementation=self.implementation)
        return out.astype(q.dtype), None

    def check(self, *, head_dim, num_heads, num_kv_heads, dtype, page_size=16):
        if self.implementation != "cudnn":
            return None
        if jax.default_backend() != "gpu":
            return f"the {jax.default_backend()} platform (it needs a CUDA GPU)"
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"{jnp.dtype(dtype).name} (it runs bf16 or f16)"
        return None

    def __repr__(self) -> str:
        return f"CudnnBackend(implementation={self.implementation!r})"


# The kernel's two masks: a DSpine block is causal after its prefix like the target.
KERNEL_MASK = {"causal": "causal", "causal_block": "causal",
               "bidirectional_block": "bidirectional"}


class PallasBackend(AttentionBackend):
    name = "pallas"

    def __init__(self, implementation: str | None = None, interpret: bool | None = None):
        """implementation: "pallas_gpu" | "pallas_tpu"; default the platform's kernel,
        and the GPU kernel interpreted where there is none (CPU)."""
        from pallas_kernels.platform import backend_implementation

        native = backend_implementation()
        if implementation is None:
            implementation = native if native != "xla" else "pallas_gpu"
        if implementation not in ("pallas_gpu", "pallas_tpu"):
            raise ConfigError(f"pallas attention implementation must be pallas_gpu or "
                              f"pallas_tpu, got {implementation!r}")
        self.implementation = implementation
        self.interpret = (implementation != native) if interpret is None else interpret

    def paged(self, q, k, v, metadata, pages):
        from pallas_kernels import ragged_paged_attention

        if metadata.mask not in KERNEL_MASK:
            raise ValueError(f"the pallas backend has no paged {metadata.mask!r} mask")
        dtype = pages[0].dtype
        out, k_pages, v_pages = ragged_paged_attention(
            q.astype(dtype), k.astype(dtype), v.astype(dtype), *pages, metadata.page_table,
            metadata.kv_lens, metadata.q_lens, mask=KERNEL_MASK[metadata.mask],
            implementation=self.implementation, interpret=self.interpret)
        return out.astype(q.dtype), (k_pages, v_pages)

    def packed(self, qkv, metadata, pages=None, *, rotation, num_kv_heads):
        """Paged calls hand the op one packed operand: the GPU kernel reads q, k and v at
        their offsets, with no split. One XLA fusion rotates q and k into it; with the
        `rpa_rope` switch the operand goes unrotated with its rotation and the kernel
        rotates them as it loads them; `rpa_packed` off splits them first."""
        from pallas_kernels import ragged_paged_attention
        from pallas_kernels.switches import current

        switches = current()
        if not metadata.is_paged or not switches.rpa_packed:
            return super().packed(qkv, metadata, pages, rotation=rotation,
                                  num_kv_heads=num_kv_heads)
        if metadata.mask not in KERNEL_MASK:
            raise ValueError(f"the pallas backend has no paged {metadata.mask!r} mask")
        dtype = pages[0].dtype
        if switches.rpa_rope:
            rope = rotation
        else:
            (qkv, _, _), rope = rotate_qk(qkv, None, None, rotation, num_kv_heads), None
        out, k_pages, v_pages = ragged_paged_attention(
            qkv.astype(dtype), None, None, *pages, metadata.page_table, metadata.kv_lens,
            metadata.q_lens, mask=KERNEL_MASK[metadata.mask], rope=rope,
            implementation=self.implementation, interpret=self.interpret)
        return out.astype(qkv.dtype), (k_pages, v_pages)

    def check(self, *, head_dim, num_heads, num_kv_heads, dtype, page_size):
        from pallas_kernels.ragged_paged_attention import common

        group = num_heads // max(num_kv_heads, 1)
        if head_dim not in common.HEAD_DIMS:
            return f"head dim {head_dim} (supported: {', '.join(map(str, common.HEAD_DIMS))})"
        if num_heads % num_kv_heads or not 1 <= group <= common.MAX_GROUP:
            return (f"{num_heads} query heads over {num_kv_heads} kv heads (supported: "
                    f"1 to {common.MAX_GROUP} query heads per kv head)")
        if jnp.dtype(dtype) not in common.DTYPES:
            return f"dtype {jnp.dtype(dtype).name} (supported: bfloat16, float32)"
        if page_size not in common.PAGE_SIZES:
            return (f"page size {page_size} (supported: "
                    f"{', '.join(map(str, common.PAGE_SIZES))})")
        return None

    def __repr__(self) -> str:
        return f"PallasBackend({self.implementation!r}, interpret={self.interpret})"


def default_backend_name() -> str:
    """pallas where the platform has a compiled kernel (CUDA GPU, TPU), else xla."""
    from pallas_kernels.platform import backend_implementation

    return "xla" if backend_implementation() == "xla" else "pallas"


_warned: set = set()


def select_backend(choice: str | AttentionBackend | None, models, *, dtype,
                   page_size: int) -> AttentionBackend:
    """The backend for a decoder whose models have the layer configs `models`.

    choice: an AttentionBackend, "pallas", "xla", or "auto"/None (pallas where the
    platform compiles it, else xla). An explicit pallas that cannot run these shapes is
    an error naming what the kernel supports; "auto" falls back to xla with a warning,
    once per reason."""
    if isinstance(choice, AttentionBackend):
        backend, explicit = choice, True
    else:
        name = "auto" if choice is None else choice
        if name not in BACKENDS:
            raise ConfigError(f"attention backend must be one of {', '.join(BACKENDS)}; "
                              f"got {name!r}")
        explicit = name != "auto"
        if name == "auto":
            name = default_backend_name()
        backend = PallasBackend() if name == "pallas" else XlaBackend()
    for config in models:
        reason = backend.check(head_dim=config.head_dim, num_heads=config.num_attention_heads,
                               num_kv_heads=config.num_key_value_heads, dtype=dtype,
                               page_size=page_size)
        if reason is None:
            continue
        message = f"the {backend.name} attention backend does not support {reason}"
        if explicit:
            raise ConfigError(f"{message}; use attention_backend='xla' "
                              "(--attention-backend xla)")
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"{message}; falling back to the xla attention backend",
                          stacklevel=2)
        return XlaBackend()
    return backend
