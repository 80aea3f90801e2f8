"""The decode layer's fused ops for NVIDIA GPUs (Hopper), written with Pallas's Triton
lowering.

R rows, D input width, O output width, H head dim, BR/BN/BD row/output/input tiles.

A decode step of a small target runs a few rows (R = batch x tokens <= 16) through every
layer: each matmul reads a few MB of weights and does almost no arithmetic, so XLA's
kernels per layer (the norm's reduction and scaling, three to five matrix-vector
reductions, RoPE's halves and their concatenation, the residual adds) each cost a few
microseconds of launch and tail for well under a microsecond of reading. These kernels
fold the element-wise work into the matmuls that need it:

  norm_qkv_rope   rms_norm -> q, k, v projections -> q/k per-head norm -> RoPE
  norm_swiglu     rms_norm -> gate and up projections -> silu(gate) * up
  matmul_residual a @ W^T + residual (the attention's output projection, the MLP's down)

The grid is (ceil(R / BR), output tiles): program (i, j) owns BR rows and one tile of
output columns, reads its slice of the weights once (float32 accumulation) and
recomputes the row norm it needs (a pass over BR x D activations, trivial beside its
weight slice). The input width is walked in BD-wide chunks, then its remainder in whole
power-of-two pieces (`input_pieces`), so no load is masked. A head's two RoPE halves are
two [BR, H/2] tiles of one program, so the rotation and a per-head norm happen in
registers. Rows past R are read clamped to R - 1 and never stored.

Compiled and timed only where a CUDA GPU is present (tests marked `gpu`); elsewhere the
tests run them in Pallas interpret mode (see ragged_paged_attention/gpu.py for why these
kernels use the Triton lowering).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK_R = 16                    # Triton's dot needs 16 rows; a decode step fills one tile
NUM_WARPS = 4
NUM_STAGES = 3                  # weight chunks in flight: a program's loop is latency-bound


def default_block_d(d: int) -> int:
    """The input chunk: the widest of 64/32/16 dividing D."""
    return next(b for b in (64, 32, 16) if d % b == 0)


def input_pieces(d: int, bd: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """How a program walks an input width D: (n, tail) with n chunks of BD in a loop,
    then the rest as (offset, width) pieces of descending powers of two (576 with BD 512:
    one chunk, then (512, 64)). Every load is then a whole aligned block, none masked:
    Triton tiles are powers of two, and a masked load of the columns past D is a gather."""
    if bd < 16 or bd & (bd - 1):
        raise ValueError(f"block_d must be a power of two >= 16, got {bd}")
    if d % 16:
        raise ValueError(f"the input width must be a multiple of 16, got {d}")
    n, offset, tail = d // bd, d // bd * bd, []
    while offset < d:
        width = 1 << ((d - offset).bit_length() - 1)
        tail.append((offset, width))
        offset += width
    return n, tuple(tail)


def default_block_n(o: int) -> int:
    """Output columns per program: 32 where it divides O (twice the programs of 64, so a
    576-wide output still spreads its weights over 18 multiprocessors), else 16 or 64."""
    return next(b for b in (32, 16, 64) if o % b == 0)


def _check_tiles(op: str, out: int, bn: int) -> None:
    if bn < 16 or bn & (bn - 1) or out % bn:
        raise ValueError(f"{op}: block_n must be a power of two >= 16 dividing the output "
                         f"width {out}, got {bn}")


def _chunk(ref, rows, d0, bd):
    """ref[rows, d0 : d0 + BD] of a [*, D] ref (d0 a multiple of BD: see `input_pieces`).
    rows: [n] row indices, or a contiguous `pl.ds` of them."""
    return ref[rows, _aligned(d0, bd)]


def _vector_chunk(ref, d0, bd):
    """ref[d0 : d0 + BD] of a [D] ref."""
    return ref[_aligned(d0, bd)]


def _aligned(d0, bd):
    """pl.ds(d0, BD), d0 a multiple of BD: a Python int (a tail piece) or traced (a loop's)."""
    return pl.ds(d0 if isinstance(d0, int) else pl.multiple_of(d0, bd), bd)


def _walk(d, bd, piece, carry):
    """carry after piece(d0, width, carry) over D's `input_pieces`: the BD-wide chunks in
    a loop, then the tail pieces unrolled."""
    n, tail = input_pieces(d, bd)
    if n:                                   # (a chunk wider than D is never traced)
        carry = lax.fori_loop(0, n, lambda j, c: piece(j * bd, bd, c), carry)
    for d0, width in tail:
        carry = piece(d0, width, carry)
    return carry


def _rows(r: int):
    """(rows to read [BR], rows to store [BR], their mask [BR, 1]) of this program."""
    idx = pl.program_id(0) * BLOCK_R + jnp.arange(BLOCK_R, dtype=jnp.int32)
    real = idx < r
    # distinct rows past R for masked lanes: never stored on a GPU, and interpret mode
    # (which stores a masked lane by writing back what it read) drops them as out of range
    return jnp.minimum(idx, r - 1), jnp.where(real, idx, r + idx), real[:, None]


def _store(ref, rows, cols, value, real):
    keep = jnp.broadcast_to(real, value.shape)
    pltriton.store(ref.at[rows[:, None], cols[None, :]], value.astype(ref.dtype), mask=keep)


def _inverse_rms(x_ref, rows, eps, bd):
    """[BR] float32 1 / rms of the program's rows of x [R, D]."""
    d = x_ref.shape[1]

    def piece(d0, width, total):
        xs = _chunk(x_ref, rows, d0, width).astype(jnp.float32)
        return total + jnp.sum(xs * xs, axis=1)

    total = _walk(d, bd, piece, jnp.zeros((BLOCK_R,), jnp.float32))
    return lax.rsqrt(total / d + eps)


def _project(x_ref, rows, w_slices, bd, precision, norm=None):
    """The [BR, BN] float32 products of the rows of x [R, D] (rms-normed first when
    norm = (weight_ref, inverse_rms [BR])) with each (weight ref [O, D], first output
    column, BN): one pass over D in the pieces of `input_pieces`, every weight slice read
    once."""
    d = x_ref.shape[1]
    dtype = x_ref.dtype

    def piece(d0, width, accs):
        xs = _chunk(x_ref, rows, d0, width)                            # [BR, width]
        if norm is not None:
            weight_ref, inverse = norm
            xs = ((xs.astype(jnp.float32) * inverse[:, None]).astype(dtype)
                  * _vector_chunk(weight_ref, d0, width).astype(dtype)[None, :])
        return tuple(
            acc + pltriton.dot(xs, _chunk(w_ref, pl.ds(c0, bn), d0, width).astype(dtype),
                               trans_b=True, precision=precision)
            for acc, (w_ref, c0, bn) in zip(accs, w_slices))

    zeros = tuple(jnp.zeros((BLOCK_R, bn), jnp.float32) for _, _, bn in w_slices)
    return _walk(d, bd, piece, zeros)


def _qkv_kernel(x_ref, norm_ref, wq_ref, wk_ref, wv_ref, cos_ref, sin_ref, qn_ref, kn_ref,
                q_ref, k_ref, v_ref, *, eps, heads, kv_heads, half, bd, precision):
    """Program (i, j): head j of q (j < N), k (j < N + K) or v, for BR rows."""
    r = x_ref.shape[0]
    dtype = x_ref.dtype
    rows, store_rows, real = _rows(r)
    inverse = _inverse_rms(x_ref, rows, eps, bd)
    j = pl.program_id(1)
    lanes = jnp.arange(half, dtype=jnp.int32)

    def head(w_ref, out_ref, index, head_norm_ref, rotate):
        c0 = pl.multiple_of(index * 2 * half, 2 * half)
        lo = c0 + lanes
        y1, y2 = _project(x_ref, rows, ((w_ref, c0, half), (w_ref, c0 + half, half)), bd,
                          precision, norm=(norm_ref, inverse))
        y1, y2 = y1.astype(dtype), y2.astype(dtype)                    # the projection's
        if head_norm_ref is not None:
            a, b = y1.astype(jnp.float32), y2.astype(jnp.float32)
            inv = lax.rsqrt((jnp.sum(a * a, 1) + jnp.sum(b * b, 1)) / (2 * half) + eps)
            y1 = (a * inv[:, None]).astype(dtype) * head_norm_ref[pl.ds(0, half)].astype(dtype)
            y2 = (b * inv[:, None]).astype(dtype) * head_norm_ref[pl.ds(half, half)].astype(dtype)
        if rotate:
            c = cos_ref[rows, pl.ds(0, half)]
            s = sin_ref[rows, pl.ds(0, half)]
            a, b = y1.astype(jnp.float32), y2.astype(jnp.float32)
            y1, y2 = a * c - b * s, b * c + a * s
        _store(out_ref, store_rows, lo, y1, real)
        _store(out_ref, store_rows, lo + half, y2, real)

    @pl.when(j < heads)
    def _q():
        head(wq_ref, q_ref, j, qn_ref, True)

    @pl.when((j >= heads) & (j < heads + kv_heads))
    def _k():
        head(wk_ref, k_ref, j - heads, kn_ref, True)

    @pl.when(j >= heads + kv_heads)
    def _v():
        head(wv_ref, v_ref, j - heads - kv_heads, None, False)


def norm_qkv_rope_gpu(x, norm_weight, wq, wk, wv, cos, sin, *, eps, q_norm=None,
                      k_norm=None, interpret=False, block_d=None, num_warps=None,
                      num_stages=None):
    r, d = x.shape
    half = cos.shape[1]
    heads, kv_heads = wq.shape[0] // (2 * half), wk.shape[0] // (2 * half)
    with_head_norm = q_norm is not None
    kernel = functools.partial(_qkv_kernel, eps=eps, heads=heads, kv_heads=kv_heads,
                               half=half, bd=block_d or default_block_d(d),
                               precision=_precision(x))
    if not with_head_norm:
        kernel = _without_head_norms(kernel)
    args = (x, norm_weight, wq, wk, wv, cos, sin) + ((q_norm, k_norm) if with_head_norm else ())
    return _call(kernel, "norm_qkv_rope", heads + 2 * kv_heads,
                 [jax.ShapeDtypeStruct((r, w.shape[0]), x.dtype) for w in (wq, wk, wv)],
                 args, num_warps, num_stages, interpret)


def _precision(x):
    """Full float32 products for float32 activations (bf16's default otherwise)."""
    return lax.Precision.HIGHEST if x.dtype == jnp.float32 else None


def _call(kernel, name: str, programs: int, out_shape, args: tuple, num_warps, num_stages,
          interpret: bool):
    """One of the ops' pallas_calls: grid (row tiles of args[0], `programs` output tiles),
    every operand and output a whole-array ref the kernel indexes itself."""
    outputs = len(out_shape) if isinstance(out_shape, list) else None
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(args[0].shape[0], BLOCK_R), programs),
        in_specs=[pl.no_block_spec] * len(args),
        out_specs=pl.no_block_spec if outputs is None else [pl.no_block_spec] * outputs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or NUM_WARPS,
                                                num_stages=num_stages or NUM_STAGES),
        interpret=interpret,
        name=name,
    )(*args)


def _without_head_norms(kernel):
    """The q/k/v kernel for a model without q_norm/k_norm (no refs for them)."""
    def run(x_ref, norm_ref, wq_ref, wk_ref, wv_ref, cos_ref, sin_ref, q_ref, k_ref, v_ref):
        return kernel(x_ref, norm_ref, wq_ref, wk_ref, wv_ref, cos_ref, sin_ref, None, None,
                      q_ref, k_ref, v_ref)
    return run


def _swiglu_kernel(x_ref, norm_ref, wg_ref, wu_ref, out_ref, *, eps, bn, bd, precision):
    dtype = x_ref.dtype
    rows, store_rows, real = _rows(x_ref.shape[0])
    inverse = _inverse_rms(x_ref, rows, eps, bd)
    c0 = pl.multiple_of(pl.program_id(1) * bn, bn)
    cols = c0 + jnp.arange(bn, dtype=jnp.int32)
    gate, up = _project(x_ref, rows, ((wg_ref, c0, bn), (wu_ref, c0, bn)), bd, precision,
                        norm=(norm_ref, inverse))
    gate, up = gate.astype(dtype), up.astype(dtype)
    # jax.nn.silu's roundings: sigmoid, then the product with its input, then with up
    act = gate * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(dtype)
    _store(out_ref, store_rows, cols, act.astype(dtype) * up, real)


def norm_swiglu_gpu(x, norm_weight, w_gate, w_up, *, eps, interpret=False, block_d=None,
                    block_n=None, num_warps=None, num_stages=None):
    r, d = x.shape
    f = w_gate.shape[0]
    bn = block_n or default_block_n(f)
    _check_tiles("norm_swiglu", f, bn)
    kernel = functools.partial(_swiglu_kernel, eps=eps, bn=bn,
                               bd=block_d or default_block_d(d), precision=_precision(x))
    return _call(kernel, "norm_swiglu", f // bn, jax.ShapeDtypeStruct((r, f), x.dtype),
                 (x, norm_weight, w_gate, w_up), num_warps, num_stages, interpret)


def _residual_kernel(a_ref, w_ref, res_ref, out_ref, *, bn, bd, precision):
    rows, store_rows, real = _rows(a_ref.shape[0])
    c0 = pl.multiple_of(pl.program_id(1) * bn, bn)
    cols = c0 + jnp.arange(bn, dtype=jnp.int32)
    (y,) = _project(a_ref, rows, ((w_ref, c0, bn),), bd, precision)
    res = res_ref[rows, pl.ds(c0, bn)]
    _store(out_ref, store_rows, cols, res + y.astype(a_ref.dtype).astype(res.dtype), real)


def matmul_residual_gpu(a, weight, residual, *, interpret=False, block_d=None, block_n=None,
                        num_warps=None, num_stages=None):
    r, i = a.shape
    o = weight.shape[0]
    bn = block_n or default_block_n(o)
    _check_tiles("matmul_residual", o, bn)
    kernel = functools.partial(_residual_kernel, bn=bn, bd=block_d or default_block_d(i),
                               precision=_precision(a))
    return _call(kernel, "matmul_residual", o // bn,
                 jax.ShapeDtypeStruct((r, o), residual.dtype), (a, weight, residual),
                 num_warps, num_stages, interpret)
