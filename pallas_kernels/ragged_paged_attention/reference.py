"""What `ragged_paged_attention` computes, in plain JAX; also its `implementation="xla"` path.

B batch rows, T query tokens of this call, N query heads, K kv heads, G = N // K, H head
dim, P pages in the pool, PS page size, PPS pages per row (page_table's width), S = PPS*PS.

1. Write: token t < q_lens[b] of row b goes to absolute position
   p = kv_lens[b] - q_lens[b] + t, i.e. page page_table[b, p // PS], slot p % PS.
2. Read: gather each row's pages into a contiguous [S, K, H] view. Positions >= kv_lens[b]
   (unwritten slots, and pages past the row's first ceil(kv_len / PS) table entries) are
   replaced by zeros before use, so whatever those pages hold (NaN in the tests) never
   reaches the output. This path gathers all PPS pages of every row, so it costs
   O(PPS * PS) per row whatever kv_lens is: the kernels read only the first kv_lens keys.
3. Attend, scores and softmax in float32 as `dspine_jax.layers.dot_product_attention`:
   causal: query t (position p above) sees keys [0, p]; bidirectional: every query of
   row b sees keys [0, kv_lens[b]). Queries t >= q_lens[b] are padding: output zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .common import MASK_VALUE, default_scale, write_new_tokens


def ragged_paged_attention_reference(q, new_k, new_v, k_pages, v_pages, page_table,
                                     kv_lens, q_lens, *, mask="causal", sm_scale=None):
    b, t, n, h = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    g = n // kv_heads
    scale = default_scale(sm_scale, h)
    k_pages, v_pages = write_new_tokens(new_k, new_v, k_pages, v_pages, page_table,
                                        kv_lens, q_lens)

    # [B, S, K, H]: the rows' pages in order (out-of-range table entries are clamped by
    # the gather and zeroed below with every other position >= kv_len)
    s = page_table.shape[1] * page_size
    k = k_pages[page_table].reshape(b, s, kv_heads, h)
    v = v_pages[page_table].reshape(b, s, kv_heads, h)
    key_pos = jnp.arange(s, dtype=jnp.int32)
    key_valid = key_pos[None, :] < kv_lens[:, None]                     # [B, S]
    k = jnp.where(key_valid[:, :, None, None], k, 0)
    v = jnp.where(key_valid[:, :, None, None], v, 0)

    # [B, T] absolute query positions
    q_pos = (kv_lens - q_lens)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    # [B, T, S]
    visible = jnp.broadcast_to(key_valid[:, None, :], (b, t, s))
    if mask == "causal":
        visible = visible & (key_pos[None, None, :] <= q_pos[:, :, None])

    qg = q.reshape(b, t, kv_heads, g, h)
    # [B, K, G, T, S]
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, None], scores * scale, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v, preferred_element_type=jnp.float32)
    out = out.reshape(b, t, n, h)
    q_valid = jnp.arange(t, dtype=jnp.int32)[None, :] < q_lens[:, None]  # [B, T]
    out = jnp.where(q_valid[:, :, None, None], out, 0).astype(q.dtype)
    return out, k_pages, v_pages
