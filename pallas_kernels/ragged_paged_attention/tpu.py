"""Ragged paged attention as a Mosaic TPU kernel (`jax.experimental.pallas.tpu`).

B batch rows, T query tokens, N query heads, K kv heads, G = N // K, H head dim, PS page
size, PPS pages per row, M = T * G packed query rows, BM query rows per tile, QT = ceil(M /
BM) query tiles.

Why not JAX's shipped `jax.experimental.pallas.ops.tpu.ragged_paged_attention`: it reads
one combined pool [P, PS, 2K, H] with K and V interleaved (ours keeps separate k_pages /
v_pages, and interleaving per call would copy the whole pool), it takes flattened ragged
queries (cu_q_lens), it does not write the new tokens, and its mask is causal only, so
DFlash's bidirectional block after a context cannot run on it. This kernel does both masks
over our layout.

The kernel. Scalar prefetch brings page_table (flattened), kv_lens and q_lens into SMEM;
the grid is (B, QT, PPS) and step (b, r, j) takes query tile r of row b and receives page
page_table[b, j] of both pools by a DMA that the Pallas pipeline issues from the
BlockSpec's index map (double-buffered, so page j + 1 is in flight while page j is used).
Query tiles of at most BM = 256 rows bound the VMEM a long prefill chunk needs (the
accumulator and running max/sum are [K, BM, 128-lane] float32): a 512-token chunk of a
G = 4 model packs 2,048 rows, 8 tiles. Past the row's last valid page the index map
repeats that page, so no DMA is issued and the body is skipped (pl.when): pages outside
the row's first ceil(kv_len / PS) table entries are never fetched. (A row with kv_len 0
fetches the pool's page 0 once and uses nothing of it.) The body runs an online softmax
for each kv head over the tile's packed queries (row m = t * G + g), scores in f32;
slots of the last page past kv_len are masked and zeroed before use. The new tokens are
written first by an XLA scatter into the (donated) pools.

Tuning left open (never run on a TPU): one page per grid step is small for PS = 16;
fetching several pages per step needs hand-written DMAs (make_async_copy per page) as in
the shipped kernel; a causal query tile still visits the pages after its last query (they
are masked, not skipped). Runs on the CPU in TPU interpret mode (interpret=True), and
lowers to Mosaic for the TPU platform on any host (`dspine_benchmarks.lower_for_tpu`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .common import OP, MASK_VALUE, default_scale, pack_queries, unpack_outputs, write_new_tokens

MAX_QUERY_ROWS = 256      # BM: packed query rows per grid step (VMEM scratch [K, BM, *])
LANES = 128


def _kernel(page_table_ref, kv_lens_ref, q_lens_ref,          # scalar prefetch (SMEM)
            q_tok_ref, q_ref, k_ref, v_ref,                    # inputs (VMEM blocks)
            o_ref,                                             # output
            m_sc, l_sc, acc_sc,                                # scratch
            *, page_size, kv_heads, pages_per_seq, causal, scale, precision):
    b = pl.program_id(0)
    j = pl.program_id(2)
    kv_len = kv_lens_ref[b]
    ctx = kv_len - q_lens_ref[b]

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(j * page_size < kv_len)
    def _page():
        # [1, PS] key positions of this page; [M, 1] query positions
        key_pos = j * page_size + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        visible = key_pos < kv_len
        if causal:
            visible = visible & (key_pos <= ctx + q_tok_ref[...])
        # [PS, 1]: zero the slots past kv_len before they meet the matmul
        slot_valid = (j * page_size + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
                      < kv_len)
        for kh in range(kv_heads):
            q = q_ref[kh]                                          # [M, H]
            k = k_ref[kh::kv_heads, :]                             # [PS, H]
            v = v_ref[kh::kv_heads, :]
            k = jnp.where(slot_valid, k, 0).astype(q.dtype)
            v = jnp.where(slot_valid, v, 0).astype(q.dtype)
            # [M, PS]
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * scale
            s = jnp.where(visible, s, MASK_VALUE)
            m_prev = m_sc[kh][:, :1]                               # [M, 1]
            l_prev = l_sc[kh][:, :1]
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
            l_new = alpha * l_prev + p.sum(axis=1, keepdims=True)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=precision, preferred_element_type=jnp.float32)
            acc_sc[kh] = acc_sc[kh] * alpha + pv
            m_sc[kh] = jnp.broadcast_to(m_new, m_sc.shape[1:])
            l_sc[kh] = jnp.broadcast_to(l_new, l_sc.shape[1:])

    @pl.when(j == pages_per_seq - 1)
    def _finish():
        l = l_sc[...][:, :, :1]
        o_ref[...] = acc_sc[...] / jnp.where(l > 0, l, 1.0)


def ragged_paged_attention_tpu(q, new_k, new_v, k_pages, v_pages, page_table, kv_lens,
                               q_lens, *, mask="causal", sm_scale=None, interpret=False,
                               block_m=None):
    """block_m: packed query rows per tile (default: all M, or MAX_QUERY_ROWS when M is
    larger); a tile shorter than M must be a multiple of 8 (the TPU's sublanes)."""
    b, t, n, h = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    group = n // kv_heads
    m = t * group
    block_m = block_m or (m if m <= MAX_QUERY_ROWS else MAX_QUERY_ROWS)
    if block_m < m and block_m % 8:
        raise ValueError(f"{OP}: a query tile shorter than T * G = {m} rows must be a "
                         f"multiple of 8, got block_m={block_m}")
    q_tiles = -(-m // block_m)
    m_pad = q_tiles * block_m
    pages_per_seq = page_table.shape[1]

    k_pages, v_pages = write_new_tokens(new_k, new_v, k_pages, v_pages, page_table,
                                        kv_lens, q_lens)
    # [B, K, M_pad, H]; rows past M are padding (their token index is past T: dropped)
    qp = jnp.pad(pack_queries(q, kv_heads), ((0, 0), (0, 0), (0, m_pad - m), (0, 0)))
    q_tok = (jnp.arange(m_pad, dtype=jnp.int32) // group)[:, None]   # [M_pad, 1]
    # [P, PS * K, H]: page rows slot-major, kv head kh of slot s at row s * K + kh
    k_rows = k_pages.reshape(num_pages, page_size * kv_heads, h)
    v_rows = v_pages.reshape(num_pages, page_size * kv_heads, h)

    def page_map(i, r, j, pt, kvl, ql):
        last = jnp.maximum(pl.cdiv(kvl[i], page_size) - 1, 0)
        page = pt[i * pages_per_seq + jnp.minimum(j, last)]
        return jnp.clip(page, 0, num_pages - 1), 0, 0

    kernel = functools.partial(
        _kernel, page_size=page_size, kv_heads=kv_heads, pages_per_seq=pages_per_seq,
        causal=mask == "causal", scale=default_scale(sm_scale, h),
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, q_tiles, pages_per_seq),
        in_specs=[
            pl.BlockSpec((block_m, 1), lambda i, r, j, *_: (r, 0)),
            pl.BlockSpec((None, kv_heads, block_m, h), lambda i, r, j, *_: (i, 0, r, 0)),
            pl.BlockSpec((None, page_size * kv_heads, h), page_map),
            pl.BlockSpec((None, page_size * kv_heads, h), page_map),
        ],
        out_specs=pl.BlockSpec((None, kv_heads, block_m, h),
                               lambda i, r, j, *_: (i, 0, r, 0)),
        scratch_shapes=[
            pltpu.VMEM((kv_heads, block_m, LANES), jnp.float32),
            pltpu.VMEM((kv_heads, block_m, LANES), jnp.float32),
            pltpu.VMEM((kv_heads, block_m, h), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, kv_heads, m_pad, h), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention",
    )(page_table.reshape(-1), kv_lens, q_lens, q_tok, qp, k_rows, v_rows)
    return unpack_outputs(out[:, :, :m], q.shape, q_lens, q.dtype), k_pages, v_pages
