"""The threshold by search instead of a sort: the rule every search implementation
follows, written once over order-preserving int32 keys of the float32 logits.

With key(x) increasing in x, tau is found by two searches for the largest key where a
monotone predicate (true, then false) holds:
1. t_k, the k-th largest value (repeats counted): the largest key t with
   count(keys >= t) >= k; the row's minimum without top-k.
2. Over the softmax of the top-k set (every entry above t_k and k - their count copies of
   t_k, as the sort's first k ranks), with e = exp(x - max) and z that set's mass: the
   largest key t in [t_k, max] whose higher entries hold at least top_p * z. The kept set
   is the entries above it (one past it, in key order), or down to t_k when even t_k's
   higher entries hold less (and always when top_p >= 1).
Each search is rounds(W) rounds of a W-way split of [lo, hi] (W a power of two, WAYS by
default): the candidates lo + min(j * step, width), j < W, step = width // W + 1, keep
the largest true one and the interval below the smallest false one; a round divides the
width by W, so 32 / log2(W) rounds (8 of 16 ways, 6 of 64) close any int32 interval.
More ways: fewer rounds (launches, on a GPU), more compares per entry in each. Masked
sums round differently from the sort's cumsum: a token whose mass-before
lies within float32 rounding of top_p can fall either side.

Keys are int32 bit patterns: x's float bits, the magnitude bits flipped for negative x,
so signed int32 order is float order (-0.0 just below +0.0). Interval widths can exceed
2^31, so they are kept as unsigned values in int32 bit patterns (`unsigned_less`, logical
shifts), which wrap alike in XLA and Triton.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

WAYS = 16
_SIGN = -2**31


def _bits(ways: int) -> int:
    """log2(ways), for a power of two >= 2."""
    bits = ways.bit_length() - 1
    if ways < 2 or ways != 1 << bits:
        raise ValueError(f"ways must be a power of two >= 2, got {ways}")
    return bits


def rounds(ways: int) -> int:
    """Rounds of a `ways`-way split that close any int32 interval (ways**rounds >= 2**32)."""
    return -(-32 // _bits(ways))


def ordered_key(x: jax.Array) -> jax.Array:
    """float32 -> int32 with the same order."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def key_value(key: jax.Array) -> jax.Array:
    """ordered_key's inverse."""
    return lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), jnp.float32)


def unsigned_less(a: jax.Array, b: jax.Array) -> jax.Array:
    """a < b for int32 bit patterns read as uint32."""
    return (a ^ _SIGN) < (b ^ _SIGN)


def candidates(lo: jax.Array, hi: jax.Array, ways: int = WAYS) -> jax.Array:
    """[..., ways] keys splitting [lo, hi] ([...] each), candidate 0 = lo."""
    width = hi - lo                                            # uint32 bits: hi >= lo
    step = lax.shift_right_logical(width, _bits(ways)) + 1     # width // W + 1 <= 2^(32-b)
    offset = jnp.arange(ways, dtype=jnp.int32) * step[..., None]   # < 2^32: fits uint32
    width = width[..., None]
    return lo[..., None] + jnp.where(unsigned_less(offset, width), offset, width)


def narrow(cand: jax.Array, ok: jax.Array, hi: jax.Array):
    """The next round's (lo, hi) from candidates [..., W] and the predicate at each
    (candidate 0, the current lo, counts as true)."""
    ok = ok | (jnp.arange(cand.shape[-1]) == 0)
    lo = jnp.max(jnp.where(ok, cand, jnp.iinfo(jnp.int32).min), -1)
    hi = jnp.min(jnp.where(ok, hi[..., None], cand - 1), -1)
    return lo, hi


def xla_round_stat(keys: jax.Array, e: jax.Array):
    """A search round's reduction in plain JAX: stat(kind, cand [R, W], active [R]) -> [R, W],
    for every row (active is only a hint), one masked reduction over the vocabulary
    ([R, W, V] compares, fused)."""
    def stat(kind, cand, active):
        del active
        if kind == "count_ge":
            return jnp.sum(keys[:, None, :] >= cand[:, :, None], -1)
        return jnp.sum(jnp.where(keys[:, None, :] > cand[:, :, None], e[:, None, :], 0.0), -1)
    return stat


def search_threshold(scaled: jax.Array, k: jax.Array, top_p: jax.Array,
                     round_stat=None, ways: int = WAYS) -> jax.Array:
    """The rule above, no sort and no data-dependent control flow.
    scaled [R, V] float32, k [R] int32 in 1..V, top_p [R] -> tau [R] float32.

    round_stat(keys, scaled, top) -> stat computes each round's reduction:
    stat("count_ge", cand, active) the entries at or above each candidate, and
    stat("mass_gt", cand, active) the sum of exp(x - top) over the entries above each; it
    may return zeros for rows where active is false (their search is not needed).
    Default: `xla_round_stat`. ways: candidates per round (a power of two)."""
    vocab = scaled.shape[-1]
    keys = ordered_key(scaled)                                         # [R, V]
    lo, hi = jnp.min(keys, -1), jnp.max(keys, -1)
    top = jnp.max(scaled, -1)                                          # [R]
    e = jnp.exp(scaled - top[:, None])
    stat = round_stat(keys, scaled, top) if round_stat else xla_round_stat(keys, e)

    def largest_where(pred, lo, hi):
        for _ in range(rounds(ways)):
            cand = candidates(lo, hi, ways)                            # [R, W]
            lo, hi = narrow(cand, pred(cand), hi)
        return lo

    # 1. t_k: at least k entries at or above it (rows without top-k: the minimum)
    has_top_k = k < vocab
    t_k = largest_where(lambda c: stat("count_ge", c, has_top_k) >= k[:, None], lo, hi)
    t_k = jnp.where(has_top_k, t_k, lo)
    above = keys > t_k[:, None]
    mass = jnp.sum(jnp.where(above, e, 0.0), -1)
    z = mass + (k - jnp.sum(above, -1)) * jnp.exp(key_value(t_k) - top)
    # 2. the largest key whose higher entries hold at least top_p * z
    nucleus = (top_p < 1) & (mass >= top_p * z)
    last_heavy = largest_where(
        lambda c: stat("mass_gt", c, nucleus) >= (top_p * z)[:, None], t_k, hi)
    return key_value(jnp.where(nucleus, last_heavy + 1, t_k))
