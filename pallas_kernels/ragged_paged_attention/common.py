"""Checks and the KV write shared by every implementation of `ragged_paged_attention`.

B batch rows, T query tokens of this call, N query heads, K kv heads, G = N // K query
heads per kv head, H head dim, P pages in the pool, PS page size, PPS pages per row.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..rope import rotate_half_split

OP = "ragged_paged_attention"
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)   # as dspine_jax.layers.MASK_VALUE
HEAD_DIMS = (64, 128)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
PAGE_SIZES = (8, 16, 32, 64, 128, 256)
MAX_GROUP = 8
MASKS = ("causal", "bidirectional")
IMPLEMENTATIONS = ("auto", "xla", "pallas_tpu", "pallas_gpu")


def check_inputs(q, new_k, new_v, k_pages, v_pages, page_table, kv_lens, q_lens, *,
                 mask, sm_scale, implementation, rope=None) -> None:
    """Raises ValueError (at trace time: only shapes and dtypes are read) on bad input."""
    def fail(what):
        raise ValueError(f"{OP}: {what}")

    if mask not in MASKS:
        fail(f"mask must be one of {MASKS}, got {mask!r}")
    if implementation not in IMPLEMENTATIONS:
        fail(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if sm_scale is not None and not isinstance(sm_scale, (int, float)):
        fail(f"sm_scale must be a Python number or None, got {type(sm_scale).__name__}")
    if q.ndim != 4:
        fail(f"q must be [B, T, N, H], got shape {q.shape}")
    if k_pages.ndim != 4:
        fail(f"k_pages must be [P, page_size, K, H], got shape {k_pages.shape}")
    _, page_size, kv_heads, _ = k_pages.shape
    if (new_k is None) != (new_v is None):
        fail("new_k and new_v must both be arrays, or both None (q packed)")
    check_rope(rope, q.shape)
    if new_k is None:
        if q.shape[2] <= 2 * kv_heads:
            fail(f"packed q must be [B, T, N + 2K, H] with N >= 1 and K={kv_heads} (from "
                 f"the pools), got shape {q.shape}")
        q, new_k, new_v = split_packed(q, kv_heads)
    b, t, n, h = q.shape
    if v_pages.shape != k_pages.shape:
        fail(f"v_pages shape {v_pages.shape} differs from k_pages shape {k_pages.shape}")
    for name, x in (("new_k", new_k), ("new_v", new_v)):
        if x.shape != (b, t, kv_heads, h):
            fail(f"{name} must be [B, T, K, H] = {(b, t, kv_heads, h)} (from q and the "
                 f"pools), got {x.shape}")
    if k_pages.shape[3] != h:
        fail(f"pool head dim {k_pages.shape[3]} differs from q head dim {h}")
    if h not in HEAD_DIMS:
        fail(f"head dim must be one of {HEAD_DIMS}, got {h}")
    if t < 1:
        fail(f"q must hold at least one token per row (T >= 1), got T={t}")
    if kv_heads < 1 or n % kv_heads:
        fail(f"query heads N={n} must be a multiple of kv heads K={kv_heads}")
    if not 1 <= n // kv_heads <= MAX_GROUP:
        fail(f"query heads per kv head G=N/K must be in 1..{MAX_GROUP}, got {n // kv_heads}")
    if page_size not in PAGE_SIZES:
        fail(f"page_size must be one of {PAGE_SIZES}, got {page_size}")
    dtypes = {jnp.dtype(x.dtype) for x in (q, new_k, new_v, k_pages, v_pages)}
    if len(dtypes) != 1:
        fail(f"q, new_k, new_v, k_pages and v_pages must share one dtype, got "
             f"{sorted(str(d) for d in dtypes)}")
    if dtypes.pop() not in DTYPES:
        fail(f"dtype must be bfloat16 or float32, got {q.dtype}")
    if page_table.ndim != 2 or page_table.shape[0] != b:
        fail(f"page_table must be [B, pages_per_seq] with B={b}, got {page_table.shape}")
    for name, x in (("kv_lens", kv_lens), ("q_lens", q_lens)):
        if x.shape != (b,):
            fail(f"{name} must be [B] = ({b},), got {x.shape}")
    for name, x in (("page_table", page_table), ("kv_lens", kv_lens), ("q_lens", q_lens)):
        if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
            fail(f"{name} must be int32, got {x.dtype}")


def check_rope(rope, q_shape) -> None:
    """rope: None or (cos, sin), each [B, T, H/2] float32."""
    if rope is None:
        return
    b, t, _, h = q_shape
    want = (b, t, h // 2)
    if (not isinstance(rope, (tuple, list)) or len(rope) != 2
            or any(getattr(x, "shape", None) != want for x in rope)):
        raise ValueError(f"{OP}: rope must be (cos, sin), each [B, T, H/2] = {want}")
    if any(jnp.dtype(x.dtype) != jnp.dtype(jnp.float32) for x in rope):
        raise ValueError(f"{OP}: rope's cos and sin must be float32")


def rotate_qk(q, new_k, new_v, rope, kv_heads: int):
    """q and new_k rotated by rope = (cos, sin) in XLA (packed: new_k = new_v = None)."""
    if new_k is None:
        n = q.shape[2] - 2 * kv_heads
        return jnp.concatenate([rotate_half_split(q[:, :, :n + kv_heads], *rope),
                                q[:, :, n + kv_heads:]], axis=2), None, None
    return rotate_half_split(q, *rope), rotate_half_split(new_k, *rope), new_v


def split_packed(qkv, kv_heads: int):
    """[B, T, N + 2K, H] -> q [B, T, N, H], new_k and new_v [B, T, K, H]."""
    n = qkv.shape[2] - 2 * kv_heads
    return qkv[:, :, :n], qkv[:, :, n:n + kv_heads], qkv[:, :, n + kv_heads:]


def write_new_tokens(new_k, new_v, k_pages, v_pages, page_table, kv_lens, q_lens):
    """Scatters token t < q_lens[b] of row b to absolute position kv_lens[b] - q_lens[b] + t.

    Padding tokens get an out-of-range page id and are dropped, so they write nothing.
    In place when the caller donates the pools (an XLA scatter into a donated buffer).
    """
    num_pages, page_size = k_pages.shape[:2]
    b, t = new_k.shape[:2]
    tok = jnp.arange(t, dtype=jnp.int32)
    # [B, T] absolute positions of this call's tokens
    pos = (kv_lens - q_lens)[:, None] + tok[None, :]
    valid = tok[None, :] < q_lens[:, None]
    entry = jnp.clip(pos // page_size, 0, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, entry, axis=1)
    page = jnp.where(valid, page, num_pages)          # out of range: dropped
    slot = pos % page_size
    k_pages = k_pages.at[page, slot].set(new_k, mode="drop")
    v_pages = v_pages.at[page, slot].set(new_v, mode="drop")
    return k_pages, v_pages


def pack_queries(q, kv_heads: int):
    """[B, T, N, H] -> [B, K, T*G, H]: the G heads x T tokens that share a kv head, row t*G+g."""
    b, t, n, h = q.shape
    g = n // kv_heads
    return q.reshape(b, t, kv_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, t * g, h)


def unpack_outputs(out, q_shape, q_lens, dtype):
    """[B, K, T*G, H] -> [B, T, N, H], zeros at padding queries (t >= q_lens[b])."""
    b, t, n, h = q_shape
    kv_heads = out.shape[1]
    out = out.reshape(b, kv_heads, t, n // kv_heads, h).transpose(0, 2, 1, 3, 4)
    out = out.reshape(b, t, n, h)
    valid = jnp.arange(t, dtype=jnp.int32)[None, :] < q_lens[:, None]
    return jnp.where(valid[:, :, None, None], out, 0).astype(dtype)


def default_scale(sm_scale, head_dim: int) -> float:
    return float(head_dim) ** -0.5 if sm_scale is None else float(sm_scale)
