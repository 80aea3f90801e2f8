"""Ragged paged attention for NVIDIA GPUs (Hopper), written with Pallas's Triton lowering.

B batch rows, T query tokens, N query heads, K kv heads, G = N // K, H head dim, PS page
size, M = T * G packed query rows, BM/BN query/key tile, S kv splits.

Layout of the work. The G query heads x T tokens that share one kv head are packed into
the M dim of the matmuls (row m = t * G + g), so each key tile is loaded once for all of
them. The grid is (B, K * ceil(M / BM), S): flash-decoding splits each row's key range
over S programs (S picked so that B * K * M-tiles * S fills the chip's multiprocessors
about twice over; at batch 1 Qwen3-8B decode that is 8 x 33 programs), each program runs
an online softmax over its key tiles and writes an unnormalised partial (acc, max, sum);
a small XLA combine merges the S partials. A key tile of BN keys is gathered through the
page table key by key (page_table[b, pos // PS] * PS + pos % PS), so BN does not depend
on the page size and no page past the row's kv_len is touched: positions past kv_len are
clamped to the row's last key (masked out of the softmax), and the loop ends at the last
tile the program's queries can see (causal: the tile holding key ctx + t_max).

The new tokens are written first by an XLA scatter into the (donated) pools, then the
kernel reads the pools: the write moves T tokens, the read kv_len, so a fused write
would save nothing measurable.

Why Triton and not Mosaic GPU. Mosaic GPU (`plgpu`) is the supported Hopper lowering and
its TMA copies take a dynamic leading index, but (a) its pipelines fetch one rectangular
block per step, so a page gather needs a hand-written TMA-per-page loop whose page ids
must first be staged from GMEM into SMEM/registers, and (b) a Mosaic GPU kernel can only
be compiled on a GPU; this op was written with a budget of four GPU runs, while a Triton
kernel lowers on the CPU (jax.jit(...).trace(...).lower(lowering_platforms=("cuda",)))
and runs in Pallas's CPU interpret mode, so the tests run it in CI. The Triton lowering
is deprecated in JAX 0.11 but still ships; a Mosaic GPU port would keep this file's grid
and combine.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .common import MASK_VALUE, default_scale, pack_queries, unpack_outputs, write_new_tokens

LOG2E = math.log2(math.e)
DEFAULT_SM_COUNT = 132          # H100/H200 SXM


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _kernel(page_table_ref, kv_lens_ref, q_lens_ref, q_ref, k_ref, v_ref,   # inputs
            o_ref, m_ref, l_ref,                                            # outputs
            *, page_size, kv_heads, group, t_len, block_m, block_n, m_tiles, causal,
            scale_log2, precision):
    b = pl.program_id(0)
    kh = pl.program_id(1) // m_tiles
    mt = pl.program_id(1) % m_tiles
    split = pl.program_id(2)
    num_splits = pl.num_programs(2)
    pages_per_seq = page_table_ref.shape[1]

    kv_len = kv_lens_ref[b]
    ctx = kv_len - q_lens_ref[b]
    # [BM] absolute position of each packed query row (row m is token m // G)
    q_pos = ctx + (mt * block_m + jnp.arange(block_m, dtype=jnp.int32)) // group
    if causal:
        last_t = jnp.minimum((mt * block_m + block_m - 1) // group, t_len - 1)
        hi = jnp.minimum(kv_len, ctx + last_t + 1)
    else:
        hi = kv_len
    n_tiles = pl.cdiv(hi, block_n)
    per_split = pl.cdiv(n_tiles, num_splits)
    lo_tile = split * per_split
    hi_tile = jnp.minimum(n_tiles, lo_tile + per_split)
    last_key = jnp.maximum(kv_len - 1, 0)

    q = q_ref[...]                                                     # [BM, H]

    def body(tile, carry):
        acc, m_i, l_i = carry
        pos = tile * block_n + jnp.arange(block_n, dtype=jnp.int32)    # [BN]
        pos_c = jnp.minimum(pos, last_key)
        entry = jnp.minimum(pos_c // page_size, pages_per_seq - 1)
        page = page_table_ref[b, entry]
        row = (page * page_size + pos_c % page_size) * kv_heads + kh
        k = k_ref[row, :]                                              # [BN, H]
        v = v_ref[row, :]
        # [BM, BN] scores in log2 units
        s = pltriton.dot(q, k, trans_b=True, precision=precision) * scale_log2
        visible = pos[None, :] < kv_len
        if causal:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.where(visible, jnp.exp2(s - m_new[:, None]), 0.0)
        l_new = l_i * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_new, l_new

    head_dim = q.shape[-1]
    init = (jnp.zeros((block_m, head_dim), jnp.float32),
            jnp.full((block_m,), MASK_VALUE, jnp.float32),
            jnp.zeros((block_m,), jnp.float32))
    acc, m_i, l_i = lax.fori_loop(lo_tile, hi_tile, body, init)
    o_ref[...] = acc
    m_ref[...] = m_i
    l_ref[...] = l_i


def default_config(b, t, n, h, kv_heads, page_size, pages_per_seq, dtype):
    """(block_m, block_n, num_splits, num_warps, num_stages) for one call's static shape."""
    m = t * (n // kv_heads)
    block_m = min(64, max(16, _next_pow2(m)))
    itemsize = jnp.dtype(dtype).itemsize
    block_n = 64 if h * itemsize >= 256 else 128
    m_tiles = -(-m // block_m)
    programs = b * kv_heads * m_tiles
    sm_count = getattr(jax.devices()[0], "core_count", None) or DEFAULT_SM_COUNT
    max_tiles = -(-(pages_per_seq * page_size) // block_n)
    num_splits = max(1, min(-(-2 * sm_count // programs), -(-max_tiles // 2)))
    return block_m, block_n, num_splits, 4, 2


def ragged_paged_attention_gpu(q, new_k, new_v, k_pages, v_pages, page_table, kv_lens,
                               q_lens, *, mask="causal", sm_scale=None, interpret=False,
                               block_m=None, block_n=None, num_splits=None, num_warps=None,
                               num_stages=None):
    b, t, n, h = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    group = n // kv_heads
    pages_per_seq = page_table.shape[1]
    cfg = default_config(b, t, n, h, kv_heads, page_size, pages_per_seq, q.dtype)
    block_m = block_m or cfg[0]
    block_n = block_n or cfg[1]
    num_splits = num_splits or cfg[2]
    num_warps = num_warps or cfg[3]
    num_stages = num_stages or cfg[4]
    m = t * group
    m_tiles = -(-m // block_m)
    m_pad = m_tiles * block_m

    k_pages, v_pages = write_new_tokens(new_k, new_v, k_pages, v_pages, page_table,
                                        kv_lens, q_lens)
    # [B, K, M_pad, H]
    qp = pack_queries(q, kv_heads)
    qp = jnp.pad(qp, ((0, 0), (0, 0), (0, m_pad - m), (0, 0)))
    # [P * PS * K, H]: row (page * PS + slot) * K + kv_head (a free reshape)
    k_flat = k_pages.reshape(num_pages * page_size * kv_heads, h)
    v_flat = v_pages.reshape(num_pages * page_size * kv_heads, h)

    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel, page_size=page_size, kv_heads=kv_heads, group=group, t_len=t,
        block_m=block_m, block_n=block_n, m_tiles=m_tiles, causal=mask == "causal",
        scale_log2=default_scale(sm_scale, h) * LOG2E, precision=precision)
    whole = pl.no_block_spec
    o, m_max, l_sum = pl.pallas_call(
        kernel,
        grid=(b, kv_heads * m_tiles, num_splits),
        in_specs=[
            whole, whole, whole,
            pl.BlockSpec((None, None, block_m, h), lambda i, j, s: (i, j // m_tiles, j % m_tiles, 0)),
            whole, whole,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_m, h),
                         lambda i, j, s: (i, j // m_tiles, s, j % m_tiles, 0)),
            pl.BlockSpec((None, None, None, block_m),
                         lambda i, j, s: (i, j // m_tiles, s, j % m_tiles)),
            pl.BlockSpec((None, None, None, block_m),
                         lambda i, j, s: (i, j // m_tiles, s, j % m_tiles)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kv_heads, num_splits, m_pad, h), jnp.float32),
            jax.ShapeDtypeStruct((b, kv_heads, num_splits, m_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, kv_heads, num_splits, m_pad), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(page_table, kv_lens, q_lens, qp, k_flat, v_flat)

    # Combine the S partials (log2 units): [B, K, S, M, H] -> [B, K, M, H]
    o, m_max, l_sum = o[:, :, :, :m], m_max[:, :, :, :m], l_sum[:, :, :, :m]
    m_all = m_max.max(axis=2, keepdims=True)
    w = jnp.exp2(m_max - m_all)
    l_all = (w * l_sum).sum(axis=2)
    out = (w[..., None] * o).sum(axis=2) / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    return unpack_outputs(out, q.shape, q_lens, q.dtype), k_pages, v_pages
