"""Ragged paged attention for NVIDIA GPUs (Hopper), written with Pallas's Triton lowering.

B batch rows, T query tokens, N query heads, K kv heads, G = N // K, H head dim, PS page
size, M = T * G packed query rows, BM/BN query/key tile, S kv splits.

Layout of the work. The G query heads x T tokens that share one kv head are packed into
the M dim of the matmuls (row m = t * G + g, gathered straight from q), so each key tile
is loaded once for all of them; at M >= 64 (verify/draft) the matmuls are Hopper wgmma.
The grid is (B, K * ceil(M / BM), S): flash-decoding splits each row's key range over S
programs (default_config: at least two programs per multiprocessor, up to four for wide
query tiles), each program runs an online softmax over its key tiles and writes an
unnormalised partial (acc, max, sum); a small XLA combine merges the S partials and lays
them out as [B, T, N, H]: written split by split, element-wise, it is one loop fusion
(`_merge_unrolled`; by reductions over S, two). With combine="kernel" (the `rpa_combine`
switch) one small Pallas kernel does both (`_combine_kernel`: one program per (row, kv
head, query tile), an online merge over the splits), the slower way on an H200
(docs/benchmarks.md, "Engine options").

The operands. q, new_k and new_v are three arrays, or one packed [B, T, N + 2K, H]
(`TokenRows`): a layer's fused q/k/v projection, read in place at each token's row
offsets, so no XLA kernel splits it. With rope = (cos, sin) the kernel rotates q and the
new keys as it loads them (`load_rotated`: the rotate-half partner is a second load of
the same rows with the halves swapped, the tables are gathered by token), so that a
projection's output could reach the kernel untouched (the models pass it under the
`rpa_rope` switch, off: on an H100 the second load costs more than the fusion it
saves); calls it does not write itself (prefill) are rotated by XLA first, since the
pools must hold rotated keys before it.

Keys. A tile of BN keys is gathered through the page table: BN / PS page ids per tile
(scalar loads), then each key's H values, which are contiguous in the pool (the keys of
one kv head are K * H apart, so a page is no contiguous [PS, H] block). The page ids are
read as 16-bit halves: Triton's software pipeliner turns a load of >= 32 bits in the loop into
an async copy, and an async copy of page ids, which the next K/V addresses need, makes
every tile wait for all copies in flight (cp.async.wait_group 0: no overlap of loads with
the matmuls); with 16-bit loads num_stages - 1 K/V tiles stay in flight
(cp.async.wait_group 2 at 3 stages). Tiles whose keys every query row of the program
sees run unmasked; only the last tiles (kv_len, causal diagonal) are masked. Positions
past kv_len read the row's last key (masked out), and the loop ends at the last tile the
program's queries can see (causal: the tile holding key ctx + t_max), so no page past the
row's kv_len is touched.

The new tokens. For calls of at most FUSED_WRITE_MAX_T tokens per row (decode, verify,
draft) the programs read only keys [0, ctx) from the pools; the call's own keys are one
block of T keys read straight from new_k/new_v and attended by each row's last split
(the causal mask inside it), and the last program of each (row, kv head) stores the
row's new tokens into the (aliased, donated) pools while the others read, which saves
the two XLA scatter kernels per layer a small call otherwise pays. Longer calls (prefill)
are written by an XLA scatter first and read from the pools like every key.
A page id outside the pool takes no store (`store_lanes`), as the scatter drops it: the
slot engine's padding rows hold the pool size in every entry.

Why Triton and not Mosaic GPU. Mosaic GPU (`plgpu`) is the supported Hopper lowering, but
(a) its pipelines fetch one rectangular block per step, so a page gather needs a
hand-written TMA-per-page loop whose page ids must first be staged into SMEM/registers,
and (b) a Mosaic GPU kernel compiles only on a GPU, while a Triton kernel lowers on the
CPU (jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))) and runs in Pallas's
CPU interpret mode, so CI tests it. The Triton lowering is deprecated in JAX 0.11 but
still ships; a Mosaic GPU port would keep this file's grid and combine.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..platform import multiprocessors
from ..switches import current as current_switches
from .common import MASK_VALUE, default_scale, rotate_qk, unpack_outputs, write_new_tokens

LOG2E = math.log2(math.e)
# Calls of at most this many tokens per row (decode, verify, draft) have the kernel write
# them; one program per (row, kv head) does, WRITE_CHUNK tokens per store.
FUSED_WRITE_MAX_T = 64
WRITE_CHUNK = 32
COMBINES = ("unrolled", "xla", "kernel")
# The unrolled merge writes one expression per split; past this many it merges by
# reductions (compile time; a long context at batch 1 can have ~100 splits).
MAX_UNROLLED_SPLITS = 32


@dataclasses.dataclass(frozen=True)
class TokenRows:
    """Where token i = b * T + t keeps its heads in the kernel's flat [rows, H] inputs:
    q head j at row i * q_stride + j, kv head kh of the new keys/values at
    i * kv_stride + kh + k_offset / v_offset."""
    q_stride: int
    kv_stride: int
    k_offset: int = 0
    v_offset: int = 0

    @classmethod
    def separate(cls, n_heads: int, kv_heads: int) -> "TokenRows":
        """q [B, T, N, H], new_k and new_v [B, T, K, H]: three arrays."""
        return cls(n_heads, kv_heads)

    @classmethod
    def packed(cls, n_heads: int, kv_heads: int) -> "TokenRows":
        """One [B, T, N + 2K, H] array, each token's q heads, then k, then v."""
        width = n_heads + 2 * kv_heads
        return cls(width, width, n_heads, n_heads + kv_heads)

    def kv_row(self, token, kv_head):
        return token * self.kv_stride + kv_head


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def store_lanes(t_idx, q_len, page, num_pages):
    """Which of a row's new tokens the fused write stores: the real ones (t < q_len)
    whose page id is in the pool. An out-of-range id is how a row says "no page here" (the
    slot engine's padding rows, every entry the pool size) and drops the write, as
    `write_new_tokens`'s XLA scatter does; stored, it would land past the pool, in
    whatever buffer follows it."""
    return (t_idx < q_len) & (page >= 0) & (page < num_pages)


def _kernel(page_table_ref, kv_lens_ref, q_lens_ref, q_ref, new_k_ref, new_v_ref,   # inputs
            cos_ref, sin_ref, k_ref, v_ref,
            o_ref, m_ref, l_ref, k_out_ref, v_out_ref,                      # outputs
            *, page_size, kv_heads, group, t_len, block_m, block_n, m_tiles, causal,
            scale_log2, precision, fused, rows):
    """fused: the pools hold keys [0, ctx) only; this call's keys come from new_k/new_v
    and the kernel writes them into the pools (k_out_ref/v_out_ref). Otherwise the pools
    already hold every key [0, kv_len) and new_k/new_v are not read.

    rows: a `TokenRows`, where token (b, t)'s heads are in q_ref, new_k_ref and new_v_ref
    (one packed array passed three times, or three arrays).
    cos_ref, sin_ref: None, or [B * T, H/2] float32: q and the new keys are rotated here,
    as they are loaded (fused calls only)."""
    b = pl.program_id(0)
    kh = pl.program_id(1) // m_tiles
    mt = pl.program_id(1) % m_tiles
    split = pl.program_id(2)
    num_splits = pl.num_programs(2)
    pages_per_seq = page_table_ref.shape[1] // 2
    num_pages = k_ref.shape[0] // (page_size * kv_heads)

    kv_len = kv_lens_ref[b]
    q_len = q_lens_ref[b]
    ctx = kv_len - q_len
    # [BM] packed query rows m = t * G + g of this tile; rows past T * G (tile padding)
    # read token T - 1 and are dropped by the combine
    m_idx = mt * block_m + jnp.arange(block_m, dtype=jnp.int32)
    tok = jnp.minimum(m_idx // group, t_len - 1)
    q_pos = ctx + m_idx // group                                       # [BM]
    head_dim = q_ref.shape[-1]

    def load_rotated(ref, row, token):
        """[R, H] rows of ref, RoPE'd by the rotation of each one's token (b * T + t) where
        the call brings one: x * cos + rotate_half(x) * sin, the partner half read by a
        second, permuted load; float32 math, ref's dtype out."""
        x = ref[row, :]
        if cos_ref is None:
            return x
        half = head_dim // 2
        cols = jnp.arange(head_dim, dtype=jnp.int32)
        partner = ref[row[:, None], ((cols + half) % head_dim)[None, :]]
        table = (token[:, None], (cols % half)[None, :])
        sign = jnp.where(cols < half, -1.0, 1.0)[None, :]
        out = (x.astype(jnp.float32) * cos_ref[table]
               + partner.astype(jnp.float32) * sign * sin_ref[table])
        return out.astype(x.dtype)

    # q head kh * G + g of token (b, t) is row (b * T + t) * q_stride + kh * G + g,
    # gathered here (no packed copy)
    q = load_rotated(q_ref, (b * t_len + tok) * rows.q_stride + kh * group + m_idx % group,
                     b * t_len + tok)                                  # [BM, H]

    # The pool keys this program reads: [0, ctx) when fused, else [0, kv_len) (up to the
    # last one any query row of the tile sees). Keys [0, full_hi) are seen by every
    # query row: no mask there; tiles from full_hi // BN on are masked.
    if fused:
        full_hi = hi = ctx
    elif causal:
        first_t = (mt * block_m) // group
        last_t = jnp.minimum((mt * block_m + block_m - 1) // group, t_len - 1)
        full_hi = jnp.minimum(kv_len, ctx + first_t + 1)
        hi = jnp.minimum(kv_len, ctx + last_t + 1)
    else:
        full_hi = hi = kv_len
    n_tiles = pl.cdiv(hi, block_n)
    per_split = pl.cdiv(n_tiles, num_splits)
    lo_tile = jnp.minimum(split * per_split, n_tiles)
    hi_tile = jnp.minimum(n_tiles, lo_tile + per_split)
    mid_tile = jnp.clip(full_hi // block_n, lo_tile, hi_tile)
    last_key = jnp.maximum(hi - 1, 0)
    last_entry = jnp.minimum(last_key // page_size, pages_per_seq - 1)

    def page_id(entry):
        # page_table_ref is the int32 table seen as int16 pairs [B, 2 * PPS] (low half
        # first): 16-bit loads stay plain loads, where a 32-bit one would become an async
        # copy that the loop waits for, with the K/V copies, before every tile
        lo = page_table_ref[b, 2 * entry].astype(jnp.int32) & 0xFFFF
        hi = page_table_ref[b, 2 * entry + 1].astype(jnp.int32)
        return lo | (hi << 16)

    def read_page(entry):
        # an out-of-range id reads the pool's last page (as XLA's gather clamps), so a
        # bad table cannot fault; the engines never read through one
        return jnp.clip(page_id(entry), 0, num_pages - 1)

    def load_kv(tile, pos):
        # One [BN, H] tile of keys/values through the page table: each key's H values
        # are contiguous in the pool (consecutive keys of one kv head are K * H apart),
        # BN / PS page ids per tile.
        first = tile * (block_n // page_size) if block_n >= page_size else (
            tile * block_n) // page_size
        page = read_page(jnp.minimum(first, last_entry))
        for j in range(1, max(1, block_n // page_size)):
            page_j = read_page(jnp.minimum(first + j, last_entry))
            page = jnp.where(pos >= (first + j) * page_size, page_j, page)
        row = (page * page_size + pos % page_size) * kv_heads + kh
        return k_ref[row, :], v_ref[row, :]

    def update(carry, s, v, visible):
        # s: [BM, BN] raw scores; scores in log2 units are s * scale_log2
        acc, m_i, l_i = carry
        if visible is None and scale_log2 > 0:
            m_new = jnp.maximum(m_i, s.max(axis=1) * scale_log2)
            p = jnp.exp2(s * scale_log2 - m_new[:, None])
        else:
            s = s * scale_log2
            if visible is not None:
                s = jnp.where(visible, s, MASK_VALUE)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            p = jnp.exp2(s - m_new[:, None])
            if visible is not None:      # a fully masked row has m_new = MASK_VALUE
                p = jnp.where(visible, p, 0.0)
        alpha = jnp.exp2(m_i - m_new)
        l_new = l_i * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_new, l_new

    def full_tile(tile, carry):
        pos = tile * block_n + jnp.arange(block_n, dtype=jnp.int32)    # [BN], all < full_hi
        k, v = load_kv(tile, pos)
        s = pltriton.dot(q, k, trans_b=True, precision=precision)     # [BM, BN]
        return update(carry, s, v, None)

    def edge_tile(tile, carry):
        pos = tile * block_n + jnp.arange(block_n, dtype=jnp.int32)
        # positions past hi read the last key read (masked out below)
        k, v = load_kv(tile, jnp.minimum(pos, last_key))
        s = pltriton.dot(q, k, trans_b=True, precision=precision)
        visible = pos[None, :] < hi
        if causal and not fused:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        return update(carry, s, v, visible)

    carry = (jnp.zeros((block_m, head_dim), jnp.float32),
             jnp.full((block_m,), MASK_VALUE, jnp.float32),
             jnp.zeros((block_m,), jnp.float32))
    carry = lax.fori_loop(lo_tile, mid_tile, full_tile, carry)
    carry = lax.fori_loop(mid_tile, hi_tile, edge_tile, carry)

    if fused:
        # This call's keys, one block of TP >= T keys straight from new_k/new_v, attended
        # by the last split only (the other splits mask it out: no branch).
        t_pad = max(16, _next_pow2(t_len))
        t_idx = jnp.arange(t_pad, dtype=jnp.int32)
        real = t_idx < q_len                                           # [TP]
        token = b * t_len + jnp.minimum(t_idx, jnp.maximum(q_len - 1, 0))
        row = rows.kv_row(token, kh)
        # zeros where no token is: padding tokens may hold anything, 0 * NaN is NaN
        k = jnp.where(real[:, None], load_rotated(new_k_ref, row + rows.k_offset, token), 0)
        v = jnp.where(real[:, None], new_v_ref[row + rows.v_offset, :], 0)
        s = pltriton.dot(q, k, trans_b=True, precision=precision)     # [BM, TP]
        visible = real[None, :] & (split == num_splits - 1)
        if causal:
            visible = visible & ((ctx + t_idx)[None, :] <= q_pos[:, None])
        carry = update(carry, s, v, visible)
    acc, m_i, l_i = carry
    o_ref[...] = acc
    m_ref[...] = m_i
    l_ref[...] = l_i

    if fused:
        # The last program of each (row, kv head) writes this call's q_len tokens into
        # the pools, at positions ctx.. (no program reads the pools there).
        @pl.when((mt == m_tiles - 1) & (split == num_splits - 1))
        def _write():
            chunk = min(_next_pow2(t_len), WRITE_CHUNK)
            cols = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
            for start in range(0, t_len, chunk):
                t_idx = start + jnp.arange(chunk, dtype=jnp.int32)
                pos = ctx + t_idx
                page = page_id(jnp.clip(pos // page_size, 0, pages_per_seq - 1))
                real = store_lanes(t_idx, q_len, page, num_pages)
                dst = (page * page_size + pos % page_size) * kv_heads + kh
                # masked lanes get distinct rows past the pool: never stored on a GPU, and
                # interpret mode (which stores a masked lane by writing back what it read)
                # drops them as out of range instead of undoing a real lane's store
                dst = jnp.where(real, dst, k_out_ref.shape[0] + t_idx)
                token = b * t_len + jnp.minimum(t_idx, t_len - 1)
                src = rows.kv_row(token, kh)
                # [chunk, H] element indices: a masked scatter (interpret mode wants
                # every index an array)
                keep = jnp.broadcast_to(real[:, None], (chunk, head_dim))
                pltriton.store(k_out_ref.at[dst[:, None], cols],
                               load_rotated(new_k_ref, src + rows.k_offset, token), mask=keep)
                pltriton.store(v_out_ref.at[dst[:, None], cols],
                               new_v_ref[src + rows.v_offset, :], mask=keep)


def default_config(b, t, n, h, kv_heads, page_size, pages_per_seq, dtype):
    """(block_m, block_n, num_splits, num_warps, num_stages) for one call's static shape.

    Tuned on one H200 at 32k keys (benchmarks/attention_kernels.py --sweep).
    """
    m = t * (n // kv_heads)
    block_m = min(64, max(16, _next_pow2(m)))
    itemsize = jnp.dtype(dtype).itemsize
    # a K + V tile of 32 KiB (bf16 H=128: 64 keys), so that 3 pipeline stages, the q tile
    # and two programs fit one multiprocessor's shared memory
    block_n = min(128, 16384 // (h * itemsize))
    m_tiles = -(-m // block_m)
    programs = b * kv_heads * m_tiles
    sm_count = multiprocessors()
    max_tiles = -(-(pages_per_seq * page_size) // block_n)
    # at least two programs per multiprocessor
    num_splits = -(-2 * sm_count // programs)
    if block_m >= 64:
        # wide query tiles (verify/draft): up to four per multiprocessor while each
        # program keeps >= 16 key tiles (Qwen3-8B verify, batch 8: 79% of copy bandwidth
        # with 9-10 splits against 67% with 5)
        num_splits = max(num_splits, min(-(-4 * sm_count // programs), -(-max_tiles // 16)))
    num_splits = max(1, min(num_splits, -(-max_tiles // 2)))
    if block_m >= 64:
        num_stages = 3
    else:
        # decode: short programs (<= 2048 keys) want a deep pipeline (Qwen3-8B batch 1:
        # 69 us at 4 stages, 71 at 3), long ones more resident programs, which 2 stages
        # allow (batch 8: 296 us at 2 stages, 311 at 3)
        keys_per_program = -(-max_tiles // num_splits) * block_n
        num_stages = 4 if keys_per_program <= 2048 else 2
    return block_m, block_n, num_splits, 4, num_stages


def ragged_paged_attention_gpu(q, new_k, new_v, k_pages, v_pages, page_table, kv_lens,
                               q_lens, *, mask="causal", sm_scale=None, rope=None,
                               interpret=False, block_m=None, block_n=None, num_splits=None,
                               num_warps=None, num_stages=None, fused_write=None,
                               combine=None):
    """The op on a GPU (arguments as `ragged_paged_attention`; new_k = new_v = None: q
    is the packed [B, T, N + 2K, H], read in place; rope: rotated as loaded in calls the
    kernel writes itself, by XLA before the kernel in the others).

    fused_write: the kernel writes this call's tokens into the pools itself (at most
    FUSED_WRITE_MAX_T tokens per row; longer calls, prefill, are written by an XLA
    scatter first); default: the `rpa_fused_write` switch (on).
    combine: how the S partials are merged and laid out as [B, T, N, H]: "unrolled"
    (split by split, element-wise: one XLA loop fusion; by reductions past
    MAX_UNROLLED_SPLITS), "xla" (reductions over the splits: two fusions) or "kernel"
    (`_combine_kernel`, one small Pallas kernel); default: the `rpa_combine` switch
    ("unrolled"). block_m .. num_stages override `default_config`.
    """
    if fused_write is None:
        fused_write = current_switches().rpa_fused_write
    if combine is None:
        combine = current_switches().rpa_combine
    if combine not in COMBINES:
        raise ValueError(f"ragged_paged_attention: combine must be one of {COMBINES}, "
                         f"got {combine!r}")
    num_pages, page_size, kv_heads, _ = k_pages.shape
    packed = new_k is None
    b, t, width, h = q.shape
    n = width - 2 * kv_heads if packed else width
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

    fused = fused_write and t <= FUSED_WRITE_MAX_T
    if rope is not None and not fused:   # the pools take rotated keys before the kernel
        q, new_k, new_v = rotate_qk(q, new_k, new_v, rope, kv_heads)
        rope = None
    if packed:
        rows = TokenRows.packed(n, kv_heads)
        # [B * T * (N + 2K), H] (a free reshape), read as q, new_k and new_v at offsets
        q_flat = new_k_flat = new_v_flat = q.reshape(b * t * width, h)
        if not fused:
            new_k, new_v = q[:, :, n:n + kv_heads], q[:, :, n + kv_heads:]
    else:
        rows = TokenRows.separate(n, kv_heads)
        # [B * T * N, H] and [B * T * K, H] (free reshapes): the kernel gathers its rows
        q_flat = q.reshape(b * t * n, h)
        new_k_flat = new_k.reshape(b * t * kv_heads, h)
        new_v_flat = new_v.reshape(b * t * kv_heads, h)
    if not fused:
        k_pages, v_pages = write_new_tokens(new_k, new_v, k_pages, v_pages, page_table,
                                            kv_lens, q_lens)
    # [B, 2 * PPS] int16: each page id as (low, high) halves
    pt16 = lax.bitcast_convert_type(page_table, jnp.int16).reshape(b, 2 * pages_per_seq)
    # [B * T, H/2] each: the rotation of token b * T + t
    tables = () if rope is None else tuple(x.reshape(b * t, h // 2) for x in rope)
    # [P * PS * K, H]: row (page * PS + slot) * K + kv_head (a free reshape)
    pool_rows = num_pages * page_size * kv_heads
    k_flat = k_pages.reshape(pool_rows, h)
    v_flat = v_pages.reshape(pool_rows, h)

    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel, page_size=page_size, kv_heads=kv_heads, group=group, t_len=t,
        block_m=block_m, block_n=block_n, m_tiles=m_tiles, causal=mask == "causal",
        scale_log2=default_scale(sm_scale, h) * LOG2E, precision=precision,
        fused=fused, rows=rows)
    kernel = functools.partial(_optional_refs, kernel, rope=bool(tables), pools_out=fused)
    whole = pl.no_block_spec
    partial_spec = lambda *tail: pl.BlockSpec(
        (None, None, None, block_m) + tail,
        lambda i, j, s: (i, j // m_tiles, s, j % m_tiles) + (0,) * len(tail))
    out_specs = [partial_spec(h), partial_spec(), partial_spec()]
    out_shape = [
        jax.ShapeDtypeStruct((b, kv_heads, num_splits, m_pad, h), jnp.float32),
        jax.ShapeDtypeStruct((b, kv_heads, num_splits, m_pad), jnp.float32),
        jax.ShapeDtypeStruct((b, kv_heads, num_splits, m_pad), jnp.float32),
    ]
    if fused:                # the pools, written in place
        out_specs += [whole, whole]
        out_shape += [jax.ShapeDtypeStruct(k_flat.shape, k_flat.dtype)] * 2
    outs = pl.pallas_call(
        kernel,
        grid=(b, kv_heads * m_tiles, num_splits),
        in_specs=[whole] * (8 + len(tables)),
        out_specs=out_specs,
        out_shape=out_shape,
        # the pools, the last two inputs, written in place
        input_output_aliases={6 + len(tables): 3, 7 + len(tables): 4} if fused else {},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(pt16, kv_lens, q_lens, q_flat, new_k_flat, new_v_flat, *tables, k_flat, v_flat)
    o, m_max, l_sum = outs[:3]
    if fused:
        k_pages = outs[3].reshape(k_pages.shape)
        v_pages = outs[4].reshape(v_pages.shape)

    if combine == "kernel":
        out = _combine_call(o, m_max, l_sum, q_lens, (b, t, n, h), m_tiles, block_m, q.dtype,
                            interpret)
        return out, k_pages, v_pages
    o, m_max, l_sum = o[:, :, :, :m], m_max[:, :, :, :m], l_sum[:, :, :, :m]
    unrolled = combine == "unrolled" and num_splits <= MAX_UNROLLED_SPLITS
    merge = _merge_unrolled if unrolled else _merge
    return unpack_outputs(merge(o, m_max, l_sum), (b, t, n, h), q_lens, q.dtype), k_pages, v_pages


def _merge(o, m_max, l_sum):
    """The S partials (log2 units) merged: o [B, K, S, M, H], m_max and l_sum [B, K, S, M]
    -> [B, K, M, H], by reductions over S (XLA: two fusions)."""
    m_all = m_max.max(axis=2, keepdims=True)
    w = jnp.exp2(m_max - m_all)
    l_all = (w * l_sum).sum(axis=2)
    return (w[..., None] * o).sum(axis=2) / jnp.where(l_all > 0, l_all, 1.0)[..., None]


def _merge_unrolled(o, m_max, l_sum):
    """As `_merge`, written split by split: element-wise over S slices, no reduction, so
    XLA can make the merge and the layout that follows one loop fusion."""
    splits = range(o.shape[2])
    m_all = functools.reduce(jnp.maximum, [m_max[:, :, s] for s in splits])
    w = [jnp.exp2(m_max[:, :, s] - m_all) for s in splits]
    l_all = functools.reduce(jnp.add, [w[s] * l_sum[:, :, s] for s in splits])
    acc = functools.reduce(jnp.add, [w[s][..., None] * o[:, :, s] for s in splits])
    return acc / jnp.where(l_all > 0, l_all, 1.0)[..., None]


def _combine_kernel(q_lens_ref, o_ref, m_ref, l_ref, out_ref, *, num_splits, group, t_len,
                    n_heads, m_tiles, block_m):
    """Program (b, kh * m_tiles + mt): merges the S partials of its BM packed rows (log2
    units, an online merge over the splits) and stores them at their [B * T * N, H] rows,
    zeros at padding queries (t >= q_lens[b]) and none for tile padding (m >= T * G)."""
    b = pl.program_id(0)
    kh = pl.program_id(1) // m_tiles
    mt = pl.program_id(1) % m_tiles
    head_dim = o_ref.shape[-1]

    def merge(split, carry):
        acc, m_run, l_run = carry
        m_s, l_s = m_ref[split, :], l_ref[split, :]                    # [BM]
        m_new = jnp.maximum(m_run, m_s)
        alpha, w = jnp.exp2(m_run - m_new), jnp.exp2(m_s - m_new)
        acc = acc * alpha[:, None] + o_ref[split, :, :] * w[:, None]
        return acc, m_new, l_run * alpha + l_s * w

    carry = (jnp.zeros((block_m, head_dim), jnp.float32),
             jnp.full((block_m,), MASK_VALUE, jnp.float32), jnp.zeros((block_m,), jnp.float32))
    acc, _, l_all = lax.fori_loop(0, num_splits, merge, carry)
    out = acc / jnp.where(l_all > 0, l_all, 1.0)[:, None]
    m_idx = mt * block_m + jnp.arange(block_m, dtype=jnp.int32)
    tok = m_idx // group
    out = jnp.where((tok < q_lens_ref[b])[:, None], out, 0.0).astype(out_ref.dtype)
    # distinct rows for every lane, the masked ones too: interpret mode stores a masked
    # lane by writing back what it read, which would undo a real lane's store to the same row
    row = (b * t_len + tok) * n_heads + kh * group + m_idx % group
    cols = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    keep = jnp.broadcast_to((tok < t_len)[:, None], (block_m, head_dim))
    pltriton.store(out_ref.at[row[:, None], cols], out, mask=keep)


def _combine_call(o, m_max, l_sum, q_lens, q_shape, m_tiles, block_m, dtype, interpret):
    """Partials [B, K, S, M_pad(, H)] -> the op's output [B, T, N, H] in one kernel."""
    b, t, n, h = q_shape
    kv_heads, num_splits = o.shape[1], o.shape[2]
    kernel = functools.partial(_combine_kernel, num_splits=num_splits, group=n // kv_heads,
                               t_len=t, n_heads=n, m_tiles=m_tiles, block_m=block_m)
    tile = lambda *tail: pl.BlockSpec(  # noqa: E731
        (None, None, num_splits, block_m) + tail,
        lambda i, j: (i, j // m_tiles, 0, j % m_tiles) + (0,) * len(tail))
    out = pl.pallas_call(
        kernel,
        grid=(b, kv_heads * m_tiles),
        in_specs=[pl.no_block_spec, tile(h), tile(), tile()],
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((b * t * n, h), dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="ragged_paged_attention_combine",
    )(q_lens, o, m_max, l_sum)
    return out.reshape(b, t, n, h)


def _optional_refs(kernel, *refs, rope, pools_out):
    """The kernel with None for the refs this call does not have: the rotation tables
    (rope off) and the pool outputs (the pools were written before the call)."""
    refs = list(refs)
    if not rope:
        refs[6:6] = [None, None]
    if not pools_out:
        refs += [None, None]
    return kernel(*refs)
