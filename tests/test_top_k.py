"""pallas_kernels.top_k: the two-stage and the grouped top-k of long rows (the grouped one
with each of its selections, sort and XLA's TopK) equal a stable float64 sort (values and
indices, ties to the lower index), and `top_k` takes each path where its rule says so
(forced here on the CPU)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dspine_jax.sampling import first_argmax, top_k_indices
from pallas_kernels import top_k as long_rows
from pallas_kernels.switches import TOP_K_SELECTS, Switches


def stable_top_k(x, k):
    order = np.argsort(-np.asarray(x, np.float64), axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(np.asarray(x, np.float64), order, -1), order


def assert_stable_top_k(values, ids, x, k):
    """values and ids are exactly the stable float64 sort's top k of x."""
    want_v, want_i = stable_top_k(x, k)
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_array_equal(np.asarray(values, np.float64), want_v)


# (method, rows, V, k, chunk or group): V a multiple of it or not, k up to one chunk
# (two_stage) or up to the number of groups (grouped)
CASES = [("two_stage", 3, 1000, 16, 64), ("two_stage", 5, 4096, 1, 256),
         ("two_stage", 2, 300, 64, 64), ("two_stage", 4, 50, 7, 64),
         ("grouped", 3, 1000, 16, 32), ("grouped", 5, 4096, 2, 64), ("grouped", 2, 300, 10, 32),
         ("grouped", 4, 50, 7, 4), ("grouped", 2, 49152, 16, 64)]


def method(name):
    """long_rows.two_stage_top_k or long_rows.grouped_top_k, looked up at call time."""
    return getattr(long_rows, f"{name}_top_k")


@pytest.fixture(params=TOP_K_SELECTS)
def select(request):
    """The grouped top-k's tests run under each of its selections."""
    with Switches(top_k_select=request.param).active():
        yield request.param


@pytest.mark.parametrize("name,rows,v,k,size", CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
@pytest.mark.usefixtures("select")
def test_equals_stable_sort_with_ties(name, rows, v, k, size, dtype):
    """Values from {-3..3}: ties everywhere, so the indices pin down the tie order (and,
    grouped, many groups share the top maximum, so the groups chosen among equal maxima
    are pinned down too)."""
    x = np.random.default_rng(v + k).integers(-3, 4, size=(rows, v))
    values, ids = method(name)(jnp.asarray(x, dtype), k, size)
    assert ids.dtype == jnp.int32 and values.dtype == jnp.dtype(dtype)
    assert_stable_top_k(values, ids, x, k)


@pytest.mark.parametrize("name,size", [("two_stage", 64), ("grouped", 32)])
@pytest.mark.usefixtures("select")
def test_keeps_real_minus_inf_before_the_padding(name, size):
    """A row with fewer finite entries than k: its -inf entries (lowest indices first)
    fill the rest, never the padding past V."""
    x = np.full((2, 130), -np.inf, np.float32)
    x[0, [5, 77]] = [1.0, 2.0]
    values, ids = method(name)(jnp.asarray(x), 4, size)
    np.testing.assert_array_equal(ids, [[77, 5, 0, 1], [0, 1, 2, 3]])
    np.testing.assert_array_equal(values[0], [2.0, 1.0, -np.inf, -np.inf])
    assert np.asarray(ids).max() < 130


@pytest.mark.parametrize("name,seed,shape,size", [("two_stage", 1, (6, 5000), 512),
                                                  ("grouped", 3, (15, 49152), 64)])
@pytest.mark.usefixtures("select")
def test_random_rows_match_lax_order(name, seed, shape, size):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    values, ids = method(name)(jnp.asarray(x), 16, size)
    assert_stable_top_k(values, ids, x, 16)


def test_k_above_the_chunk_is_refused():
    with pytest.raises(ValueError, match="k <= chunk"):
        long_rows.two_stage_top_k(jnp.zeros((1, 100)), 65, 64)


def test_split_rule_fills_one_wave_of_the_gpu(monkeypatch):
    """A few rows are split into multiprocessors / rows chunks (>= 1,024 long, multiples
    of 128); many rows, short rows, the CPU and DSPINE_TOP_K_SPLIT=0 keep one pass."""
    monkeypatch.setattr(long_rows, "splits_rows", lambda: True)
    monkeypatch.setattr(long_rows.jax, "devices", lambda: [type("D", (), {"core_count": 132})])
    assert long_rows.split_chunk(15, 49152, 16) == 6144        # 8 chunks: 120 rows
    assert long_rows.split_chunk(1, 49152, 1) == 1024          # 48 chunks of 1,024
    assert long_rows.split_chunk(120, 49152, 16) is None       # 120 rows fill a wave
    assert long_rows.split_chunk(16384, 49152, 16) is None     # training's rows
    assert long_rows.split_chunk(4, 1500, 16) is None          # too short to split
    assert long_rows.split_chunk(15, 151936, 16) == 19072      # Qwen3: 8 chunks
    monkeypatch.undo()
    monkeypatch.setattr(long_rows.jax, "default_backend", lambda: "cpu")
    assert long_rows.split_chunk(15, 49152, 16) is None        # the CPU
    monkeypatch.setattr(long_rows.jax, "default_backend", lambda: "gpu")
    assert long_rows.splits_rows()
    with Switches(top_k_split=False).active():
        assert not long_rows.splits_rows()


def test_split_path_through_top_k_and_its_callers(monkeypatch):
    """With the split forced (as on a GPU) top_k, top_k_indices and first_argmax keep
    lax.top_k's results on rank-3 input with ties."""
    x = np.random.default_rng(2).integers(-2, 3, size=(2, 3, 4101))
    want_v, want_i = stable_top_k(x, 8)
    monkeypatch.setattr(long_rows, "splits_rows", lambda: True)
    assert long_rows.split_chunk(6, 4101, 8) == 1152           # 4 chunks, the last padded
    values, ids = long_rows.top_k(jnp.asarray(x, jnp.float32), 8)
    assert ids.shape == (2, 3, 8)
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_array_equal(np.asarray(values, np.float64), want_v)
    np.testing.assert_array_equal(top_k_indices(jnp.asarray(x, jnp.float32), 8), want_i)
    np.testing.assert_array_equal(first_argmax(jnp.asarray(x, jnp.float32)),
                                  np.argmax(x, -1))


@pytest.mark.usefixtures("select")
def test_grouped_takes_several_entries_from_one_group():
    """The whole top-k in one group (and in two): the groups beyond it hold nothing of
    it, yet k groups are still taken and the rest must not displace it."""
    x = np.zeros((2, 256), np.float32)
    x[0, 64:72] = np.arange(8, 16)              # group 2 (of 32) holds all 8
    x[1, [3, 200, 201]] = [5.0, 7.0, 6.0]       # two groups; ties at 0 fill the rest
    values, ids = long_rows.grouped_top_k(jnp.asarray(x), 8, 32)
    assert_stable_top_k(values, ids, x, 8)


def test_grouped_refuses_k_above_the_groups():
    with pytest.raises(ValueError, match="ceil\\(V / group\\)"):
        long_rows.grouped_top_k(jnp.zeros((1, 100)), 5, 32)


def test_group_rule(monkeypatch):
    """The power of two nearest sqrt(V / k) in [32, 1024], for k >= 2 and >= 4 k groups;
    k = 1, the CPU and DSPINE_TOP_K_GROUPED=0 keep the other paths."""
    monkeypatch.setattr(long_rows, "groups_rows", lambda: True)
    assert long_rows.group_size(49152, 16) == 64        # 768 maxima, then 1,024 entries
    assert long_rows.group_size(151936, 16) == 128      # Qwen3: 1,187, then 2,048
    assert long_rows.group_size(49152, 1) is None
    assert long_rows.group_size(4096, 64) is None       # 128 groups of 32 < 4 k
    assert long_rows.group_size(1 << 24, 2) == 1024
    monkeypatch.undo()
    monkeypatch.setattr(long_rows.jax, "default_backend", lambda: "cpu")
    assert long_rows.group_size(49152, 16) is None      # the CPU
    monkeypatch.setattr(long_rows.jax, "default_backend", lambda: "gpu")
    with Switches(top_k_grouped=False).active():
        assert not long_rows.groups_rows()
        assert long_rows.splits_rows()


@pytest.mark.usefixtures("select")
def test_grouped_path_through_top_k_and_its_callers(monkeypatch):
    """With grouping forced (as on a GPU) top_k and top_k_indices keep lax.top_k's results
    on rank-3 input with ties, and first_argmax (k = 1) takes another path."""
    x = np.random.default_rng(4).integers(-2, 3, size=(2, 3, 4101))
    want_v, want_i = stable_top_k(x, 8)
    monkeypatch.setattr(long_rows, "groups_rows", lambda: True)
    calls = []
    grouped = long_rows.grouped_top_k
    monkeypatch.setattr(long_rows, "grouped_top_k",
                        lambda *a: calls.append(a[1:]) or grouped(*a))
    values, ids = long_rows.top_k(jnp.asarray(x, jnp.float32), 8)
    assert calls == [(8, 32)]                                  # 129 groups of 32
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_array_equal(np.asarray(values, np.float64), want_v)
    np.testing.assert_array_equal(top_k_indices(jnp.asarray(x, jnp.float32), 8), want_i)
    np.testing.assert_array_equal(first_argmax(jnp.asarray(x, jnp.float32)),
                                  np.argmax(x, -1))
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_sorted_top_k_orders_by_value_then_id(dtype):
    """Ids in any order along the row (as the grouped path's chosen groups are): equal
    values go to the lower id, not the earlier position; the extremes of an integer
    dtype and both float zeros rank as values."""
    rng = np.random.default_rng(7)
    ids = np.stack([rng.permutation(300) for _ in range(3)]).astype(np.int32)
    x = rng.integers(-3, 4, size=(3, 300))
    if dtype == "int32":
        x[0, :2] = [np.iinfo(np.int32).max, np.iinfo(np.int32).min]
    values, got = long_rows.sorted_top_k(jnp.asarray(x, dtype), jnp.asarray(ids), 20)
    key = np.lexsort((ids, -np.asarray(x, np.float64)), axis=-1)[:, :20]
    np.testing.assert_array_equal(got, np.take_along_axis(ids, key, -1))
    np.testing.assert_array_equal(np.asarray(values, np.float64),
                                  np.take_along_axis(np.asarray(x, np.float64), key, -1))
    if dtype != "int32":
        zeros = jnp.asarray([[-0.0, 0.0, -0.0, 1.0]], dtype)
        _, got = long_rows.sorted_top_k(zeros, jnp.asarray([[3, 2, 1, 0]], jnp.int32), 3)
        np.testing.assert_array_equal(got, [[0, 1, 2]])     # 1.0, then the zeros by id


def test_top_k_rows_benchmark_times_every_path(tmp_path):
    """The benchmark runs every path (its ids checked against lax.top_k first) and writes
    one JSON row per path."""
    import json

    from dspine_benchmarks import top_k_rows

    out = tmp_path / "rows.jsonl"
    top_k_rows.main(["--rows", "2", "--vocab", "4096", "--iters", "2", "--repeats", "1",
                     "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["path"] for r in rows] == ["lax", "split", "grouped-topk", "grouped-sort"]
    assert all(r["us"] > 0 and r["floor_us"] > 0 and r["vocab"] == 4096 for r in rows)
