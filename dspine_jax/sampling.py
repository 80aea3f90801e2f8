"""Token sampling: temperature, top-k and top-p, per row, under jit.

`warp_logits` is the single definition of the sampled distribution; speculative decoding
applies it to both the target (p) and the drafter (q) so the two are warped alike.
Order follows transformers: temperature, then top-k, then top-p on what top-k kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dspine_jax import row_keys
from dspine_jax.runtime.requests import validate_sampling
from pallas_kernels import switches
from pallas_kernels import top_k as long_rows
from pallas_kernels.warp_threshold import warp_threshold as threshold_rows
from pallas_kernels.warp_threshold import warp_threshold_reference
from pallas_kernels.warp_threshold.search import key_value, ordered_key


@struct.dataclass
class SamplingParams:
    temperature: jax.Array  # [B] float32; 0 means greedy
    top_p: jax.Array        # [B] float32 in (0, 1]; 1 disables
    top_k: jax.Array        # [B] int32; 0 disables
    # Static: every row is greedy, so no sort over the vocabulary is traced at all
    # (a batch compiles once per value of this flag).
    all_greedy: bool = struct.field(pytree_node=False, default=False)
    # Static: no sampled row filters (top_p >= 1 and top_k == 0 wherever temperature > 0),
    # so the warp is the temperature alone and no threshold (a sort of the vocabulary on a
    # GPU) is traced. False is always correct; True is a promise about every such row.
    all_unfiltered: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def create(cls, batch_size: int, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0) -> "SamplingParams":
        validate_sampling(temperature, top_p, top_k)
        full = lambda v, dt: jnp.full((batch_size,), v, dt)  # noqa: E731
        return params_for_mode(full(temperature, jnp.float32), full(top_p, jnp.float32),
                               full(top_k, jnp.int32),
                               batch_sampling_mode(temperature, top_p, top_k))


# What a batch's rows ask of the sampler, as the static flags a program is compiled for:
# every row greedy; sampled rows, none with top-k or top-p; any row filtering.
SAMPLING_MODES = ("greedy", "unfiltered", "filtered")


def batch_sampling_mode(temperature, top_p, top_k) -> str:
    """The SAMPLING_MODES entry of rows with these [R] settings (host arrays); a greedy
    row's top-p/top-k never matter (its token is the argmax)."""
    sampled = np.asarray(temperature) > 0
    if not sampled.any():
        return "greedy"
    filters = (np.asarray(top_p) < 1) | (np.asarray(top_k) > 0)
    if not (filters & sampled).any() and unfiltered_fast_path():
        return "unfiltered"
    return "filtered"


def params_for_mode(temperature: jax.Array, top_p: jax.Array, top_k: jax.Array,
                    mode: str) -> SamplingParams:
    """SamplingParams of [R] settings whose rows `batch_sampling_mode` puts in `mode`."""
    if mode not in SAMPLING_MODES:
        raise ValueError(f"sampling mode must be one of {SAMPLING_MODES}, got {mode!r}")
    return SamplingParams(temperature, top_p, top_k, all_greedy=mode == "greedy",
                          all_unfiltered=mode != "filtered")


def unfiltered_fast_path() -> bool:
    """Whether `batch_sampling_mode` puts batches without top-k/top-p in "unfiltered"; the
    `warp_unfiltered` switch off (DSPINE_WARP_UNFILTERED=0) keeps them on the general path
    (benchmarks' before column)."""
    return switches.current().warp_unfiltered


def top_k_indices(x: jax.Array, k: int) -> jax.Array:
    """Indices [..., k] int32 of the k largest entries along the last axis (ties to the
    lower index), by `pallas_kernels.top_k.top_k`: a rank-2 TopK on a CPU (a higher rank
    becomes a full sort of each row there), grouped or in two stages over long rows on a
    GPU."""
    return long_rows.top_k(x, k)[1]


def _per_row(x: jax.Array, ndim: int) -> jax.Array:
    """[B] -> [B, 1, ..., 1] to broadcast against logits [B, ..., V]."""
    return x.reshape(x.shape + (1,) * (ndim - 1))


def _row_params(params: SamplingParams, lead: tuple[int, ...], vocab: int):
    """(k [R], top_p [R]) of rows [B, ...] flattened to R: k = V without top-k."""
    row = lambda x: jnp.broadcast_to(_per_row(x, len(lead)), lead).reshape(-1)  # noqa: E731
    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab)
    return row(k).astype(jnp.int32), row(params.top_p)


def _sorted_threshold(scaled: jax.Array, params: SamplingParams) -> jax.Array:
    """The smallest kept value of temperature-scaled logits [B, ..., V] -> [B, ..., 1], by a
    full sort of the vocabulary (`warp_threshold_reference`): the definition `warp_logits`
    applies."""
    lead, vocab = scaled.shape[:-1], scaled.shape[-1]
    k, top_p = _row_params(params, lead, vocab)
    tau = warp_threshold_reference(scaled.reshape(-1, vocab), k, top_p)
    return tau.reshape(lead + (1,))


def scale_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """logits [B, ..., V] / temperature in float32 (rows with temperature 0 scaled by 1)."""
    t = _per_row(jnp.where(params.temperature > 0, params.temperature, 1.0), logits.ndim)
    return logits.astype(jnp.float32) / t


def warp_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """logits [B, ..., V] -> temperature-scaled logits, -inf outside the top-k/top-p set.

    Rows with temperature 0 are scaled by 1 (their sample is the argmax anyway).
    """
    scaled = scale_logits(logits, params)
    if params.all_unfiltered:
        return scaled
    return jnp.where(scaled >= _sorted_threshold(scaled, params), scaled, -jnp.inf)


# The GPU warp's threshold implementation for each value of the `warp_threshold` switch.
# The default, the Pallas search, takes less device time than a sort of each row at every
# row count timed, one row (an AR step at batch 1) to 512 (docs/benchmarks.md, "The top-p
# threshold on an H100").
THRESHOLD_IMPLEMENTATIONS = {"pallas": "pallas_gpu", "sort": "sort", "search": "search"}


def gpu_threshold_implementation() -> str:
    """How the branch-free warp finds its rows' threshold (`pallas_kernels.warp_threshold`):
    the sort-free search with each round one Pallas launch, a sort of the vocabulary, or
    the search in XLA. The `warp_threshold` switch (DSPINE_WARP_THRESHOLD)."""
    return THRESHOLD_IMPLEMENTATIONS[switches.current().warp_threshold]


def branch_free() -> bool:
    """Whether to trace selections without data-dependent control flow: on a GPU each
    `lax.cond` or `fori_loop` step in a decode step waits for the host to read its
    predicate, and a sort of the vocabulary is cheap, so the sort beats the partial top-k
    with bisection there. On CPUs (and TPUs) the sort is what costs, so the partial top-k
    stays."""
    return jax.default_backend() == "gpu"


# Sizes of the partial top-k tried before `warp_threshold` falls back to a full sort.
THRESHOLD_CAPS = (64, 1024)


def warp_threshold(scaled: jax.Array, params: SamplingParams,
                   caps: tuple[int, ...] = THRESHOLD_CAPS) -> jax.Array:
    """tau [B, ...] such that `warp_logits` keeps exactly the tokens with scaled >= tau
    (-inf: every token is kept), for scaled = scale_logits(logits) [B, ..., V].

    The same set as `warp_logits`, found without sorting the vocabulary:
    * rows without top-k/top-p (and greedy rows, whose warp is never used) get -inf with
      no selection at all (and nothing is traced when `params.all_unfiltered`);
    * the others take the top-m values (m = caps[0]; XLA's TopK, on a CPU far cheaper
      than a sort of the row) and run warp_logits' cumulative rule on them, which decides
      the set unless the kept set (or an active top-k) is longer;
    * a longer top-p set (no top-k, or top-k >= V) is found by bisection: the kept set is
      {v : mass of the tokens above v < top_p}, monotone in v, so 32 halvings of the
      ordered float32 range find its smallest member (32 masked sums);
    * only a top-k between m and V whose top-p set is also longer than m pays the full
      sort (later caps: a larger TopK first).
    On a GPU (`branch_free`) every filtered row's threshold comes from one call of
    `pallas_kernels.warp_threshold` instead (the `warp_threshold` switch says how).
    top_p >= 1 counts as disabled (warp_logits' float cumsum can also drop a tail whose
    mass rounds away, ~1e-7 of probability). Masked sums and cumsums round differently,
    so a token whose mass-before lies within float32 rounding of top_p can fall either
    side (an error of that order of probability)."""
    nd = scaled.ndim
    vocab = scaled.shape[-1]
    lead = scaled.shape[:-1]
    if params.all_unfiltered:
        return jnp.full(lead, -jnp.inf, jnp.float32)
    if branch_free():
        on = (params.temperature > 0) & ((params.top_p < 1) | (params.top_k > 0))
        k, top_p = _row_params(params, lead, vocab)
        rows = scaled.reshape(-1, vocab)
        found = threshold_rows(rows, k, top_p,
                               implementation=gpu_threshold_implementation()).reshape(lead)
        return jnp.where(_per_row(on, nd - 1), found, -jnp.inf)
    row = lambda x: jnp.broadcast_to(_per_row(x, nd - 1), lead).reshape(-1)  # noqa: E731
    k_eff, top_p = _row_params(params, lead, vocab)
    filtered = ((top_p < 1) | (k_eff < vocab)) & row(params.temperature > 0)
    flat = scaled.reshape(-1, vocab)
    unfiltered = jnp.full(flat.shape[:1], -jnp.inf, jnp.float32)
    caps = sorted({min(c, vocab) for c in caps})

    def exact():
        return _sorted_threshold(scaled, params).reshape(-1)

    def attempt(level):
        if level == len(caps):
            return exact()
        m = caps[level]
        vals = jax.lax.top_k(flat, m)[0]                                  # [R, m] descending
        rank = jnp.arange(m)
        in_k = rank[None, :] < k_eff[:, None]
        # The softmax runs over the top-k set, or over the whole vocabulary without top-k.
        lse = jnp.where(k_eff <= m,
                        jax.nn.logsumexp(jnp.where(in_k, vals, -jnp.inf), axis=-1),
                        jax.nn.logsumexp(flat, axis=-1))
        probs = jnp.where(in_k, jnp.exp(vals - lse[:, None]), 0.0)
        keep = ((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]) & in_k
        n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
        tau = jnp.take_along_axis(vals, (n_keep - 1)[:, None], axis=-1)[:, 0]
        decided = (k_eff <= m) | ((k_eff == vocab) & (n_keep < m)) | ~filtered
        tau = jnp.where(filtered, tau, -jnp.inf)
        if level == 0:
            # undecided rows without an active top-k: bisection; the rest: later levels
            bisectable = decided | (k_eff == vocab)

            def longer():
                more = jnp.where(k_eff == vocab, _bisect_top_p(flat, top_p), tau)
                return jax.lax.cond(jnp.all(bisectable), lambda: more,
                                    lambda: jnp.where(bisectable, more, attempt(1)))

            return jax.lax.cond(jnp.all(decided), lambda: tau,
                                lambda: jnp.where(decided, tau, longer()))
        return jax.lax.cond(jnp.all(decided), lambda: tau,
                            lambda: jnp.where(decided, tau, attempt(level + 1)))

    tau = jax.lax.cond(jnp.any(filtered), lambda: attempt(0), lambda: unfiltered)
    return tau.reshape(lead)


def _bisect_top_p(flat: jax.Array, top_p: jax.Array) -> jax.Array:
    """flat [R, V] scaled logits, top_p [R] -> the smallest float32 t with
    mass(flat > t) < top_p (softmax over the whole row): `warp_logits`' top-p threshold
    without top-k, by bisection over the ordered float32 values."""
    probs = jax.nn.softmax(flat, axis=-1)
    lo = ordered_key(jnp.min(flat, -1))
    hi = ordered_key(jnp.max(flat, -1))       # mass above the max is 0 < top_p

    def body(_, bounds):
        lo, hi = bounds
        mid = lo + jax.lax.shift_right_logical(hi - lo, 1)    # hi - lo read unsigned
        mass = jnp.sum(jnp.where(flat > key_value(mid)[:, None], probs, 0.0), -1)
        ok = mass < top_p
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    _, hi = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return key_value(hi)


def warp_stats(logits: jax.Array, params: SamplingParams):
    """(scaled [B, ..., V], tau [B, ...], log_norm [B, ...]): the warped distribution
    softmax(warp_logits(logits)) without building it: token v has probability
    exp(scaled_v - log_norm) where scaled_v >= tau, else 0 (`warped_probability`)."""
    scaled = scale_logits(logits, params)
    tau = warp_threshold(scaled, params)
    log_norm = jax.nn.logsumexp(jnp.where(scaled >= tau[..., None], scaled, -jnp.inf), -1)
    return scaled, tau, log_norm


def warped_probability(scaled_values: jax.Array, tau: jax.Array,
                       log_norm: jax.Array) -> jax.Array:
    """Probabilities of given scaled logits under a warp's (tau, log_norm); any shapes that
    broadcast."""
    return jnp.where(scaled_values >= tau, jnp.exp(scaled_values - log_norm), 0.0)


def first_argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the largest value), int32, through
    TopK (`top_k_indices`), which a CPU runs faster than argmax's variadic reduce. Same
    result for non-NaN input (TopK puts lower indices first)."""
    return top_k_indices(x, 1)[..., 0]


def greedy_rows_argmax(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """first_argmax(logits) [B, ...] where some row of the batch is greedy; when none is,
    the argmax is never used and a cond skips it (zeros; not on a GPU, see branch_free)."""
    if branch_free():
        return first_argmax(logits)
    return jax.lax.cond(jnp.any(params.temperature <= 0), lambda: first_argmax(logits),
                        lambda: jnp.zeros(logits.shape[:-1], jnp.int32))


def sample_categorical(probs: jax.Array, rng: jax.Array, block: int = 256) -> jax.Array:
    """One draw per row from unnormalised probabilities [..., V] >= 0 (some positive),
    rng one key or one per row of the first axis (`row_keys`):
    an inverse CDF in vocabulary order, in two levels (sums of blocks of `block` tokens,
    then the cumsum inside the chosen block), so only reductions touch the whole row
    (on a CPU cheaper than Gumbel-max `categorical` or a full-row cumsum). int32 [...]."""
    vocab = probs.shape[-1]
    lead = probs.shape[:-1]
    nb = -(-vocab // block)
    padded = jnp.pad(probs.reshape(-1, vocab), ((0, 0), (0, nb * block - vocab)))
    blocks = padded.reshape(-1, nb, block)                              # [R, nb, block]
    sums = jnp.sum(blocks, -1)                                          # [R, nb]
    # (0, 1]; one key per row of `lead`'s first axis, or one key for all
    u = 1.0 - (row_keys.uniform(rng, lead).reshape(-1) if row_keys.per_row(rng)
               else jax.random.uniform(rng, (padded.shape[0],)))
    cdf = jnp.cumsum(sums, -1)
    target = u * cdf[:, -1]
    j = jnp.minimum(jnp.sum(cdf < target[:, None], -1), nb - 1)         # the block
    before = jnp.where(j > 0, jnp.take_along_axis(cdf, jnp.maximum(j - 1, 0)[:, None],
                                                  -1)[:, 0], 0.0)
    inside = jnp.take_along_axis(blocks, j[:, None, None], 1)[:, 0]     # [R, block]
    within = jnp.cumsum(inside, -1)
    i = jnp.minimum(jnp.sum(within < (target - before)[:, None], -1), block - 1)
    index = jnp.minimum(j * block + i, vocab - 1)
    # Rounding between the two levels can land on a zero-probability token (an error far
    # below 1e-6 of probability); take the most likely token of the block then.
    hit = jnp.take_along_axis(padded, index[:, None], -1)[:, 0] > 0
    index = jnp.where(hit, index, j * block + jnp.argmax(inside, -1))
    return index.reshape(lead).astype(jnp.int32)


def sample_tokens(logits: jax.Array, params: SamplingParams, rng: jax.Array) -> jax.Array:
    """logits [B, V] -> tokens [B] int32: argmax where temperature is 0, else a sample
    (rng: one key, or [B] keys: see `row_keys`)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if params.all_greedy:
        return greedy
    # warp_logits' set as verification warps p (warp_stats: no sort of the row; its unused
    # normaliser is dropped by the compiler)
    scaled, tau, _ = warp_stats(logits, params)
    sampled = row_keys.categorical(rng, jnp.where(scaled >= tau[..., None], scaled, -jnp.inf))
    return jnp.where(params.temperature > 0, sampled.astype(jnp.int32), greedy)


def target_probabilities(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The distribution sampling draws from: softmax of the warped logits, or the argmax's
    one-hot at temperature 0. [B, ..., V] float32."""
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1])
    if params.all_greedy:
        return one_hot
    warped = jax.nn.softmax(warp_logits(logits, params), axis=-1)
    return jnp.where(_per_row(params.temperature, logits.ndim) > 0, warped, one_hot)
