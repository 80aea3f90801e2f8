"""ragged_paged_attention: every implementation against a float64 numpy reference.

One test body runs against each implementation: "xla" (the reference), "pallas_tpu" in
TPU interpret mode and "pallas_gpu" in Pallas interpret mode (the GPU kernel uses the
Triton lowering, whose kernels run in interpret mode on the CPU), all on the CPU; the
`gpu`-marked tests run the same body compiled (interpret=False) and skip, saying so,
where JAX has no CUDA backend.

Inputs are poisoned so that a read past a row's keys shows: pages no row uses, the pages
behind unused page-table entries, the slots of a row's last page past kv_len and the
slots this call writes are all NaN before the call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention
from pallas_kernels.ragged_paged_attention import common as rpa_common
from pallas_kernels.ragged_paged_attention import gpu as rpa_gpu
from pallas_kernels.ragged_paged_attention import tpu as rpa_tpu

# B batch rows, T query tokens, N query heads, K kv heads, G = N / K, H head dim.
# (name, T, K, G, H, dtype, mask, page_size, kv_lens, q_lens)
PS = 16
CASES = [
    ("decode_lengths_g1", 1, 2, 1, 64, "float32", "causal", PS,
     [1, PS - 1, PS, PS + 1, 3 * PS + 5], [1, 1, 1, 1, 1]),
    ("decode_g8_bf16", 1, 1, 8, 128, "bfloat16", "causal", PS,
     [PS + 1, 1, 2 * PS], [1, 1, 1]),
    ("verify_ragged_g3", 16, 2, 3, 64, "float32", "causal", PS,
     [16, PS + 1 + 5, 40, 7, 16 + PS], [16, 5, 16, 0, 16]),
    ("verify_g8_bf16", 16, 1, 8, 128, "bfloat16", "causal", PS,
     [PS - 1, 33, 16], [3, 16, 16]),
    ("draft_bidirectional_g3_bf16", 16, 2, 3, 128, "bfloat16", "bidirectional", PS,
     [16 + PS, 17, 50, 9], [16, 1, 16, 0]),
    ("draft_bidirectional_g8_f32", 16, 1, 8, 64, "float32", "bidirectional", PS,
     [PS + 16, 20, PS], [16, 4, 16]),
    ("empty_rows_and_prefill", 16, 2, 1, 128, "float32", "causal", PS,
     [0, 16, 12, 3 * PS], [0, 16, 12, 0]),
    ("page_size_8", 16, 3, 1, 64, "bfloat16", "causal", 8, [1, 8, 9, 30], [1, 8, 9, 16]),
    ("page_size_32_bidirectional", 1, 2, 3, 64, "float32", "bidirectional", 32,
     [31, 32, 33], [1, 1, 1]),
    # several key tiles and kv splits: unmasked tiles, the masked edge, empty splits
    ("verify_long_g4_bf16", 16, 2, 4, 128, "bfloat16", "causal", PS,
     [300, 170, 16, 80], [16, 7, 16, 16]),
    ("draft_long_g3_bidirectional", 16, 1, 3, 64, "bfloat16", "bidirectional", PS,
     [261, 129, 40], [16, 16, 9]),
    # more tokens than the GPU kernel writes itself (gpu.FUSED_WRITE_MAX_T): an XLA
    # scatter writes them first
    ("prefill_long_write_first", 80, 2, 1, 64, "float32", "causal", PS,
     [80, 100, 5], [80, 70, 5]),
]
# Explicit GPU kernel configs over long rows: (case index, kernel keyword arguments)
GPU_CONFIGS = [
    (9, dict(block_n=16, num_splits=3)),             # one page per tile, uneven splits
    (9, dict(block_n=128, num_splits=1, num_stages=2)),
    (9, dict(block_n=32, num_splits=7, num_warps=8)),
    (10, dict(block_n=32, num_splits=2, block_m=16)),  # several query tiles
    (7, dict(block_n=16, num_splits=5)),             # page size 8: two pages per tile
    (2, dict(fused_write=False)),                    # pools written first by XLA
    (9, dict(fused_write=False, block_n=16, num_splits=3)),
]
LONG_PAGE_CASE = ("page_size_128_long", 16, 2, 2, 64, "bfloat16", "causal", 128,
                  [400, 129, 16], [16, 16, 3])
TOL = {"float32": 2e-5, "bfloat16": 2e-2}
INTERPRETED = ["xla", "pallas_tpu", "pallas_gpu"]


def make_case(seed, t, kv_heads, group, h, dtype, page_size, kv_lens, q_lens):
    """Random inputs with a shuffled page table and NaN wherever nothing may be read."""
    rng = np.random.default_rng(seed)
    b = len(kv_lens)
    kv_lens = np.asarray(kv_lens, np.int32)
    q_lens = np.asarray(q_lens, np.int32)
    assert np.all(q_lens <= kv_lens) and np.all(q_lens <= t)
    used = -(-kv_lens // page_size)                         # pages each row owns
    pages_per_seq = int(used.max()) + 2                     # spare entries in every row
    spare = b * pages_per_seq - int(used.sum())
    num_pages = int(used.sum()) + spare + 3                 # + pages nobody references
    ids = rng.permutation(num_pages).astype(np.int32)
    page_table = np.empty((b, pages_per_seq), np.int32)
    nxt = 0
    for i in range(b):                                      # owned pages first, then spares
        page_table[i] = ids[nxt:nxt + pages_per_seq]
        nxt += pages_per_seq
    np_dtype = jnp.dtype(dtype)
    n = kv_heads * group
    pool_shape = (num_pages, page_size, kv_heads, h)
    k_pages = np.full(pool_shape, np.nan, np.float32)
    v_pages = np.full(pool_shape, np.nan, np.float32)
    for i in range(b):
        ctx = kv_lens[i] - q_lens[i]                        # keys already in the cache
        for p in range(ctx):
            page, slot = page_table[i, p // page_size], p % page_size
            k_pages[page, slot] = rng.standard_normal((kv_heads, h))
            v_pages[page, slot] = rng.standard_normal((kv_heads, h))
    cast = lambda x: np.asarray(jnp.asarray(x, np_dtype))
    return dict(
        q=cast(rng.standard_normal((b, t, n, h))),
        new_k=cast(rng.standard_normal((b, t, kv_heads, h))),
        new_v=cast(rng.standard_normal((b, t, kv_heads, h))),
        k_pages=cast(k_pages), v_pages=cast(v_pages), page_table=page_table,
        kv_lens=kv_lens, q_lens=q_lens)


def numpy_reference(case, mask, scale):
    """Float64: the pools after the write, and attention of each valid query."""
    f64 = lambda x: np.asarray(x, np.float64)
    q = f64(case["q"])
    k_written, v_written = case["k_pages"].copy(), case["v_pages"].copy()
    page_table, kv_lens, q_lens = case["page_table"], case["kv_lens"], case["q_lens"]
    b, t, n, h = q.shape
    page_size, kv_heads = k_written.shape[1], k_written.shape[2]
    group = n // kv_heads
    for i in range(b):
        for tok in range(q_lens[i]):
            p = kv_lens[i] - q_lens[i] + tok
            k_written[page_table[i, p // page_size], p % page_size] = case["new_k"][i, tok]
            v_written[page_table[i, p // page_size], p % page_size] = case["new_v"][i, tok]
    out = np.zeros((b, t, n, h))
    for i in range(b):
        pos = np.arange(kv_lens[i])
        pages = page_table[i, pos // page_size]
        # [S, N, H]: the row's keys, each kv head repeated for its G query heads
        k = np.repeat(f64(k_written[pages, pos % page_size]), group, axis=1)
        v = np.repeat(f64(v_written[pages, pos % page_size]), group, axis=1)
        for tok in range(q_lens[i]):
            seen = kv_lens[i] - q_lens[i] + tok + 1 if mask == "causal" else kv_lens[i]
            scores = np.einsum("NH,SNH->NS", q[i, tok], k[:seen]) * scale
            probs = np.exp(scores - scores.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            out[i, tok] = np.einsum("NS,SNH->NH", probs, v[:seen])
    return out, k_written, v_written


def bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def rope_tables(case, head_dim):
    """(cos, sin) [B, T, H/2] float32 of each token's position (ctx + t), from float64."""
    b, t = case["q"].shape[:2]
    pos = (case["kv_lens"] - case["q_lens"])[:, None] + np.arange(t)[None, :]
    inv_freq = 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)
    angles = pos[..., None] * inv_freq
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def check_case(implementation, interpret, case_id, spec, kernel_kw=None, packed=False,
               rope=False):
    """kernel_kw: call the implementation's kernel directly with these config arguments.
    packed: pass q, new_k and new_v as one [B, T, N + 2K, H] array (new_k = new_v = None).
    rope: pass q and new_k unrotated with their rotation tables; the reference rotates
    them first by the pure-JAX rule (`rotate_half_split`)."""
    name, t, kv_heads, group, h, dtype, mask, page_size, kv_lens, q_lens = spec
    case = make_case(case_id, t, kv_heads, group, h, dtype, page_size, kv_lens, q_lens)
    scale = 0.7 * h ** -0.5 if case_id % 2 else None           # both default and explicit
    args = [jnp.asarray(case[k]) for k in ("q", "new_k", "new_v", "k_pages", "v_pages",
                                           "page_table", "kv_lens", "q_lens")]
    if packed:
        args[:3] = [jnp.concatenate(args[:3], axis=2), None, None]
    call_kw = {}
    if rope:
        tables = tuple(jnp.asarray(x) for x in rope_tables(case, h))
        call_kw["rope"] = tables
        for key in ("q", "new_k"):       # what the op must attend with and write
            case[key] = np.asarray(rpa_common.rotate_half_split(jnp.asarray(case[key]),
                                                                *tables))
    if kernel_kw is None:
        out, k_pages, v_pages = ragged_paged_attention(
            *args, mask=mask, sm_scale=scale, implementation=implementation,
            interpret=interpret, **call_kw)
    else:
        kernel = (rpa_tpu.ragged_paged_attention_tpu if implementation == "pallas_tpu"
                  else rpa_gpu.ragged_paged_attention_gpu)
        call = functools.partial(kernel, mask=mask, sm_scale=scale, interpret=interpret,
                                 **kernel_kw, **call_kw)
        out, k_pages, v_pages = jax.jit(call)(*args)
    ref_out, ref_k, ref_v = numpy_reference(case, mask, scale or h ** -0.5)

    assert out.shape == case["q"].shape and out.dtype == jnp.dtype(dtype)
    # the pools: new tokens at their slots, every other slot bit-unchanged (NaN included);
    # keys rotated inside a kernel may differ from XLA's rotation in the last place
    if rope:
        np.testing.assert_allclose(np.asarray(k_pages, np.float64), ref_k, equal_nan=True,
                                   rtol=TOL[dtype], atol=TOL[dtype])
    else:
        np.testing.assert_array_equal(bits(k_pages), bits(ref_k))
    np.testing.assert_array_equal(bits(v_pages), bits(ref_v))
    out = np.asarray(out, np.float64)
    valid = np.arange(t)[None, :] < case["q_lens"][:, None]
    assert np.all(out[~valid] == 0), "padding queries must output zeros"
    tol = TOL[dtype]
    np.testing.assert_allclose(out[valid], ref_out[valid], rtol=tol, atol=tol,
                               err_msg=f"{implementation} {name}")


@pytest.mark.parametrize("implementation", INTERPRETED)
@pytest.mark.parametrize("case_id", range(len(CASES)), ids=[c[0] for c in CASES])
def test_matches_float64_reference(implementation, case_id):
    check_case(implementation, implementation != "xla", case_id, CASES[case_id])


CONFIG_IDS = [f"{CASES[c][0]}-" + "-".join(f"{k}{v}" for k, v in kw.items())
              for c, kw in GPU_CONFIGS]


@pytest.mark.parametrize("config", range(len(GPU_CONFIGS)), ids=CONFIG_IDS)
def test_gpu_kernel_configs_interpreted(config):
    case_id, kw = GPU_CONFIGS[config]
    check_case("pallas_gpu", True, case_id, CASES[case_id], kernel_kw=kw)


# decode, ragged verify, a bidirectional draft, several splits, and a prefill that an XLA
# scatter writes (the packed operand split for it)
PACKED_CASES = [0, 2, 4, 9, 11]


@pytest.mark.parametrize("implementation", INTERPRETED)
@pytest.mark.parametrize("case_id", PACKED_CASES, ids=[CASES[c][0] for c in PACKED_CASES])
def test_packed_qkv_matches_float64_reference(implementation, case_id):
    """q, new_k and new_v as one packed operand: the GPU kernel reads it in place."""
    check_case(implementation, implementation != "xla", case_id, CASES[case_id], packed=True)


@pytest.mark.parametrize("implementation", INTERPRETED)
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("case_id", PACKED_CASES, ids=[CASES[c][0] for c in PACKED_CASES])
def test_rope_in_the_op_matches_float64_reference(implementation, packed, case_id):
    """q and new_k unrotated with their tables: the GPU kernel rotates them as it loads
    them (the prefill case by XLA first), the other paths by XLA."""
    check_case(implementation, implementation != "xla", case_id, CASES[case_id],
               packed=packed, rope=True)


@pytest.mark.parametrize("case_id", range(len(CASES)), ids=[c[0] for c in CASES])
def test_gpu_kernel_combine_kernel_interpreted(case_id):
    """The split-K partials merged and laid out by `_combine_kernel` instead of XLA."""
    check_case("pallas_gpu", True, case_id, CASES[case_id], kernel_kw=dict(combine="kernel"))


@pytest.mark.parametrize("case_id", [0, 9, 10], ids=[CASES[c][0] for c in (0, 9, 10)])
def test_gpu_kernel_unrolled_combine_interpreted(case_id):
    """The split-K partials merged split by split (`_merge_unrolled`), 3 and 7 splits."""
    check_case("pallas_gpu", True, case_id, CASES[case_id],
               kernel_kw=dict(combine="unrolled", num_splits=3 if case_id else 7))


def test_gpu_kernel_unrolled_combine_past_its_split_limit_interpreted(monkeypatch):
    """More splits than MAX_UNROLLED_SPLITS: merged by reductions instead."""
    monkeypatch.setattr(rpa_gpu, "MAX_UNROLLED_SPLITS", 2)
    check_case("pallas_gpu", True, 9, CASES[9], kernel_kw=dict(combine="unrolled",
                                                               num_splits=3))


def test_gpu_kernel_page_larger_than_key_tile_interpreted():
    check_case("pallas_gpu", True, 1, LONG_PAGE_CASE, kernel_kw=dict(block_n=32))


# (case index, query rows per tile): tiles of whole tokens, tiles that split a token's G
# heads, a last tile of padding rows
TPU_QUERY_TILES = [(2, 16), (10, 8), (11, 16)]


@pytest.mark.parametrize("config", range(len(TPU_QUERY_TILES)),
                         ids=[f"{CASES[c][0]}-block_m{m}" for c, m in TPU_QUERY_TILES])
def test_tpu_kernel_query_tiles_interpreted(config):
    """Packed queries over several tiles, as a long prefill chunk runs (more than
    MAX_QUERY_ROWS rows): each tile its own online softmax over the row's pages."""
    case_id, block_m = TPU_QUERY_TILES[config]
    name, t, kv_heads, group, h, dtype, mask, page_size, kv_lens, q_lens = CASES[case_id]
    assert t * group > block_m
    check_case("pallas_tpu", True, case_id, CASES[case_id], kernel_kw=dict(block_m=block_m))


def test_tpu_kernel_takes_a_long_prefill_chunk():
    """A 512-token chunk of a G = 4 model packs 2,048 query rows: tiled, not refused."""
    from pallas_kernels.ragged_paged_attention import tpu as rpa_tpu

    shapes = _shapes(b=1, t=512, n=32, k=8, h=128, p=40, pps=40, dtype=jnp.bfloat16)
    out = jax.eval_shape(lambda **a: ragged_paged_attention(
        **a, implementation="pallas_tpu", interpret=True), **shapes)
    assert out[0].shape == (1, 512, 32, 128)
    assert 512 * 4 > rpa_tpu.MAX_QUERY_ROWS


def check_rows_without_pages(implementation, interpret):
    """The slot engine's page table: entries past a row's pages hold the pool size P ("no
    page"), and its padding rows (a verify block at length 0) hold P everywhere. Nothing
    may be written through such an id; the other rows are as without them."""
    name, t, kv_heads, group, h, dtype, mask, page_size, kv_lens, q_lens = CASES[2]
    case = make_case(2, t, kv_heads, group, h, dtype, page_size, kv_lens, q_lens)
    num_pages = case["k_pages"].shape[0]
    table = case["page_table"].copy()
    used = -(-case["kv_lens"] // page_size)
    for i in range(len(table)):
        table[i, used[i]:] = num_pages
    padding = [0]                          # kv_len == q_len == 16: nothing cached yet
    assert all(case["kv_lens"][i] == case["q_lens"][i] for i in padding)
    table[padding] = num_pages
    args = [jnp.asarray(case[k]) for k in ("q", "new_k", "new_v", "k_pages", "v_pages")]
    args += [jnp.asarray(table), jnp.asarray(case["kv_lens"]), jnp.asarray(case["q_lens"])]
    out, k_pages, v_pages = ragged_paged_attention(*args, mask=mask,
                                                   implementation=implementation,
                                                   interpret=interpret)
    kept = [i for i in range(len(table)) if i not in padding]
    rows = {k: case[k][kept] for k in ("q", "new_k", "new_v", "page_table", "kv_lens",
                                       "q_lens")}
    ref_out, ref_k, ref_v = numpy_reference({**case, **rows}, mask, h ** -0.5)
    np.testing.assert_array_equal(bits(k_pages), bits(ref_k))
    np.testing.assert_array_equal(bits(v_pages), bits(ref_v))
    valid = np.arange(t)[None, :] < rows["q_lens"][:, None]
    np.testing.assert_allclose(np.asarray(out, np.float64)[kept][valid], ref_out[valid],
                               rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("implementation", INTERPRETED)
def test_rows_without_pages_write_nothing(implementation):
    """(Interpret mode drops a store past the pool by itself; the GPU kernel's own mask
    is checked by test_gpu_kernel_stores_only_into_the_pool.)"""
    check_rows_without_pages(implementation, implementation != "xla")


def test_gpu_kernel_stores_only_into_the_pool():
    """On a GPU nothing drops a store past the pool: the fused write's mask must."""
    num_pages, t = 5, 16
    t_idx = jnp.arange(t)
    page = jnp.array([0, 4, 5, 6, -1, 2**16, 3, 5] * 2)       # in range, P, past P, negative
    lanes = np.asarray(rpa_gpu.store_lanes(t_idx, 12, page, num_pages))
    # real tokens (t < 12) on pages 0, 4 and 3: lanes 0, 1, 6, 8 and 9 (14 is past q_len)
    assert np.flatnonzero(lanes).tolist() == [0, 1, 6, 8, 9]
    assert not rpa_gpu.store_lanes(t_idx, t, jnp.full((t,), num_pages), num_pages).any()


def _needs_cuda():
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a CUDA GPU; JAX backend here is {jax.default_backend()!r}")


@pytest.mark.gpu
@pytest.mark.parametrize("case_id", range(len(CASES)), ids=[c[0] for c in CASES])
def test_gpu_kernel_compiled(case_id):
    _needs_cuda()
    check_case("pallas_gpu", False, case_id, CASES[case_id])


@pytest.mark.gpu
@pytest.mark.parametrize("config", range(len(GPU_CONFIGS)), ids=CONFIG_IDS)
def test_gpu_kernel_configs_compiled(config):
    _needs_cuda()
    case_id, kw = GPU_CONFIGS[config]
    check_case("pallas_gpu", False, case_id, CASES[case_id], kernel_kw=kw)


@pytest.mark.gpu
@pytest.mark.parametrize("case_id", range(len(CASES)), ids=[c[0] for c in CASES])
def test_gpu_kernel_combine_kernel_compiled(case_id):
    _needs_cuda()
    check_case("pallas_gpu", False, case_id, CASES[case_id], kernel_kw=dict(combine="kernel"))


@pytest.mark.gpu
@pytest.mark.parametrize("case_id", PACKED_CASES, ids=[CASES[c][0] for c in PACKED_CASES])
def test_gpu_kernel_packed_qkv_compiled(case_id):
    _needs_cuda()
    check_case("pallas_gpu", False, case_id, CASES[case_id], packed=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case_id", [0, 9, 10], ids=[CASES[c][0] for c in (0, 9, 10)])
def test_gpu_kernel_unrolled_combine_compiled(case_id):
    _needs_cuda()
    check_case("pallas_gpu", False, case_id, CASES[case_id],
               kernel_kw=dict(combine="unrolled", num_splits=3 if case_id else 7))


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("case_id", PACKED_CASES, ids=[CASES[c][0] for c in PACKED_CASES])
def test_gpu_kernel_rope_compiled(packed, case_id):
    _needs_cuda()
    check_case("pallas_gpu", False, case_id, CASES[case_id], packed=packed, rope=True)


@pytest.mark.gpu
def test_gpu_kernel_rows_without_pages_compiled():
    _needs_cuda()
    check_rows_without_pages("pallas_gpu", False)


@pytest.mark.gpu
def test_auto_picks_the_gpu_kernel_on_cuda():
    _needs_cuda()
    spec = CASES[2]
    check_case("auto", False, 2, spec)


def test_auto_is_xla_on_cpu():
    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU choice")
    spec = CASES[0]
    case = make_case(0, *spec[1:6], spec[7], spec[8], spec[9])
    args = [jnp.asarray(case[k]) for k in ("q", "new_k", "new_v", "k_pages", "v_pages",
                                           "page_table", "kv_lens", "q_lens")]
    auto = ragged_paged_attention(*args, implementation="auto")
    xla = ragged_paged_attention(*args, implementation="xla")
    for a, x in zip(auto, xla):
        np.testing.assert_array_equal(bits(a), bits(x))


def _shapes(b=2, t=4, n=4, k=2, h=64, p=8, ps=16, pps=3, dtype=jnp.float32):
    s = jax.ShapeDtypeStruct
    return dict(q=s((b, t, n, h), dtype), new_k=s((b, t, k, h), dtype),
                new_v=s((b, t, k, h), dtype), k_pages=s((p, ps, k, h), dtype),
                v_pages=s((p, ps, k, h), dtype), page_table=s((b, pps), jnp.int32),
                kv_lens=s((b,), jnp.int32), q_lens=s((b,), jnp.int32))


BAD = [
    ("head dim", dict(h=32), {}),
    ("dtype", dict(dtype=jnp.float16), {}),
    ("page_size", dict(ps=12), {}),
    ("multiple of kv heads", dict(n=5, k=2), {}),
    ("G=N/K must be in 1..8", dict(n=18, k=2), {}),
    ("mask", {}, dict(mask="sliding")),
    ("implementation", {}, dict(implementation="cuda")),
]


@pytest.mark.parametrize("what,shape_kw,call_kw", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_at_trace_time(what, shape_kw, call_kw):
    shapes = _shapes(**shape_kw)
    with pytest.raises(ValueError, match="ragged_paged_attention"):
        jax.eval_shape(lambda **a: ragged_paged_attention(**a, **call_kw), **shapes)


def test_disagreeing_shapes_raise():
    shapes = _shapes()
    shapes["new_v"] = jax.ShapeDtypeStruct((2, 4, 2, 128), jnp.float32)
    with pytest.raises(ValueError, match="ragged_paged_attention: new_v"):
        jax.eval_shape(lambda **a: ragged_paged_attention(**a), **shapes)
    shapes = _shapes()
    shapes["page_table"] = jax.ShapeDtypeStruct((3, 3), jnp.int32)
    with pytest.raises(ValueError, match="ragged_paged_attention: page_table"):
        jax.eval_shape(lambda **a: ragged_paged_attention(**a), **shapes)
    shapes = _shapes()
    shapes["kv_lens"] = jax.ShapeDtypeStruct((2,), jnp.float32)
    with pytest.raises(ValueError, match="ragged_paged_attention: kv_lens must be int32"):
        jax.eval_shape(lambda **a: ragged_paged_attention(**a), **shapes)


@pytest.mark.parametrize("t", [1, 16])
def test_gpu_kernel_with_rope_lowers_for_cuda(t):
    """The kernel's Triton lowering (run on any host) takes the packed operand rotated as
    it loads it: the permuted partner loads and the table gathers lower."""
    b, n, k, h, pages, page_size = 2, 9, 3, 64, 8, 16
    spec = jax.ShapeDtypeStruct
    bf16, i32, f32 = jnp.bfloat16, jnp.int32, jnp.float32
    args = (spec((b, t, n + 2 * k, h), bf16), None, None,
            spec((pages, page_size, k, h), bf16), spec((pages, page_size, k, h), bf16),
            spec((b, 4), i32), spec((b,), i32), spec((b,), i32))
    rope = (spec((b, t, h // 2), f32), spec((b, t, h // 2), f32))

    def call(qkv, k_pages, v_pages, page_table, kv_lens, q_lens, cos, sin):
        return rpa_gpu.ragged_paged_attention_gpu(
            qkv, None, None, k_pages, v_pages, page_table, kv_lens, q_lens, rope=(cos, sin))

    text = jax.jit(call).trace(args[0], *args[3:], *rope).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "ragged_paged_attention" in text
