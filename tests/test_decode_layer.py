"""pallas_kernels.decode_layer: the fused decode-layer ops against float64 numpy (float32
inputs) and against their plain-JAX reference (bfloat16), the GPU kernels in Pallas
interpret mode; a target whose decode layers run fused against the same target through
XLA's layers (logits and written pages); a decoder built with fused layers gives AR's
greedy tokens, also speculatively. The `gpu`-marked test compiles the kernels and skips
where JAX has no CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspine_jax.config import TargetConfig
from dspine_jax.errors import ConfigError
from dspine_jax.fused_layers import FusedLayers, select_layer_kernels
from dspine_jax.generate import AutoregressiveGenerator
from dspine_jax.kv_cache import PagedKVCache
from dspine_jax.runtime.config import RuntimeConfig
from dspine_jax.runtime.offline import generate_tokens
from dspine_jax.target import TargetModel
from pallas_kernels.decode_layer import matmul_residual, norm_qkv_rope, norm_swiglu

EPS = 1e-6
INTERPRET = {"implementation": "pallas_gpu", "interpret": True}


def _draw(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def _inputs(r, d=96, heads=3, kv_heads=1, head_dim=64, f=80, dtype="float32", seed=0):
    rng = np.random.default_rng(seed + r)
    angles = rng.uniform(0, 2 * np.pi, (r, head_dim // 2))
    return dict(
        x=_draw(rng, (r, d), dtype), norm=_draw(rng, (d,), dtype),
        wq=_draw(rng, (heads * head_dim, d), dtype, 0.1),
        wk=_draw(rng, (kv_heads * head_dim, d), dtype, 0.1),
        wv=_draw(rng, (kv_heads * head_dim, d), dtype, 0.1),
        cos=jnp.asarray(np.cos(angles), jnp.float32), sin=jnp.asarray(np.sin(angles), jnp.float32),
        q_norm=_draw(rng, (head_dim,), dtype), k_norm=_draw(rng, (head_dim,), dtype),
        wg=_draw(rng, (f, d), dtype, 0.1), wu=_draw(rng, (f, d), dtype, 0.1),
        a=_draw(rng, (r, f), dtype), wd=_draw(rng, (d, f), dtype, 0.1))


# ----- float64 numpy: what the ops compute, independently of JAX --------------------------
def _f64(x):
    return np.asarray(x, np.float64)


def np_rms(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * w


def np_qkv(i, head_norms):
    h = np_rms(_f64(i["x"]), _f64(i["norm"]))
    hd = 2 * i["cos"].shape[1]
    c, s = _f64(i["cos"])[:, None], _f64(i["sin"])[:, None]

    def heads(w, norm, rotate):
        y = (h @ _f64(w).T).reshape(len(h), -1, hd)
        if norm is not None:
            y = np_rms(y, _f64(norm))
        if rotate:
            y1, y2 = y[..., :hd // 2], y[..., hd // 2:]
            y = np.concatenate([y1 * c - y2 * s, y2 * c + y1 * s], -1)
        return y.reshape(len(h), -1)

    qn, kn = (i["q_norm"], i["k_norm"]) if head_norms else (None, None)
    return heads(i["wq"], qn, True), heads(i["wk"], kn, True), heads(i["wv"], None, False)


def np_swiglu(i):
    h = np_rms(_f64(i["x"]), _f64(i["norm"]))
    g, u = h @ _f64(i["wg"]).T, h @ _f64(i["wu"]).T
    return g / (1 + np.exp(-g)) * u


def np_residual(i):
    return _f64(i["a"]) @ _f64(i["wd"]).T + _f64(i["x"])


def _qkv(i, head_norms, **kw):
    norms = (i["q_norm"], i["k_norm"]) if head_norms else ()
    return norm_qkv_rope(i["x"], i["norm"], i["wq"], i["wk"], i["wv"], i["cos"], i["sin"],
                         *norms, eps=EPS, **kw)


def _all_outputs(i, **kw) -> list:
    """q, k, v (with head norms), the SwiGLU and the residual matmul of inputs i."""
    return [*_qkv(i, True, **kw),
            norm_swiglu(i["x"], i["norm"], i["wg"], i["wu"], eps=EPS, **kw),
            matmul_residual(i["a"], i["wd"], i["x"], **kw)]


ROWS = [1, 5, 16, 19]      # one row, a few, one full tile, past one tile


@pytest.mark.parametrize("implementation", ["xla", "pallas_gpu"])
@pytest.mark.parametrize("rows", ROWS)
def test_ops_match_float64(implementation, rows):
    kw = {"implementation": implementation, "interpret": implementation != "xla"}
    i = _inputs(rows)
    for head_norms in (False, True):
        for got, want in zip(_qkv(i, head_norms, **kw), np_qkv(i, head_norms)):
            np.testing.assert_allclose(_f64(got), want, rtol=1e-5, atol=1e-5)
    got = norm_swiglu(i["x"], i["norm"], i["wg"], i["wu"], eps=EPS, **kw)
    np.testing.assert_allclose(_f64(got), np_swiglu(i), rtol=1e-5, atol=1e-5)
    got = matmul_residual(i["a"], i["wd"], i["x"], **kw)
    np.testing.assert_allclose(_f64(got), np_residual(i), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tiles", [dict(block_d=128, block_n=16, num_stages=2),
                                   dict(block_d=64, block_n=16),
                                   dict(block_d=32, block_n=16, num_warps=2)],
                         ids=["wider-than-d", "chunk-and-tail", "narrow-chunks"])
def test_tile_choices_compute_the_same(tiles):
    """The GPU kernels' tile options (interpret mode), against float64: input chunks
    wider than D = 96 and F = 80 (pieces 64 + 32 and 64 + 16), one 64-wide chunk then a
    tail piece, or 32-wide chunks (F's last 16 a tail piece)."""
    from pallas_kernels.decode_layer import gpu

    i = _inputs(5)
    qkv_tiles = {k: v for k, v in tiles.items() if k != "block_n"}
    got = gpu.norm_qkv_rope_gpu(i["x"], i["norm"], i["wq"], i["wk"], i["wv"], i["cos"],
                                i["sin"], eps=EPS, q_norm=i["q_norm"], k_norm=i["k_norm"],
                                interpret=True, **qkv_tiles)
    for g, w in zip(got, np_qkv(i, True)):
        np.testing.assert_allclose(_f64(g), w, rtol=1e-5, atol=1e-5)
    got = gpu.norm_swiglu_gpu(i["x"], i["norm"], i["wg"], i["wu"], eps=EPS, interpret=True,
                              **tiles)
    np.testing.assert_allclose(_f64(got), np_swiglu(i), rtol=1e-5, atol=1e-5)
    got = gpu.matmul_residual_gpu(i["a"], i["wd"], i["x"], interpret=True, **tiles)
    np.testing.assert_allclose(_f64(got), np_residual(i), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        gpu.matmul_residual_gpu(i["a"], i["wd"], i["x"], interpret=True, block_n=24)


def test_input_pieces_cover_the_width_in_aligned_blocks():
    from pallas_kernels.decode_layer.gpu import input_pieces

    assert input_pieces(576, 512) == (1, ((512, 64),))
    assert input_pieces(576, 64) == (9, ())
    assert input_pieces(1536, 1024) == (1, ((1024, 512),))
    assert input_pieces(80, 128) == (0, ((0, 64), (64, 16)))
    for d in range(16, 2049, 16):
        for bd in (16, 64, 128, 512):
            n, tail = input_pieces(d, bd)
            offset = n * bd
            for start, width in tail:
                assert start == offset and start % width == 0 and width & (width - 1) == 0
                offset += width
            assert offset == d
    with pytest.raises(ValueError, match="multiple of 16"):
        input_pieces(100, 64)
    with pytest.raises(ValueError, match="power of two"):
        input_pieces(96, 48)


@pytest.mark.parametrize("block_d", [64, 1024])
def test_gpu_kernels_lower_for_cuda(block_d):
    """The three kernels lower to Triton for a CUDA GPU from this CPU (what a GPU compiles)
    at SmolLM2's shapes, 8 rows: 576 in 64-wide chunks, or (BD 1024) as pieces 512 + 64
    and 1,536 as one chunk and a 512 piece."""
    from pallas_kernels.decode_layer import gpu

    bf16 = jnp.bfloat16
    spec = jax.ShapeDtypeStruct
    x, norm = spec((8, 576), bf16), spec((576,), bf16)
    wq, wkv, rope = spec((576, 576), bf16), spec((192, 576), bf16), spec((8, 32), jnp.float32)
    w_up, w_down, a = spec((1536, 576), bf16), spec((576, 1536), bf16), spec((8, 1536), bf16)
    calls = [(lambda *t: gpu.norm_qkv_rope_gpu(*t, eps=EPS, block_d=block_d),
              (x, norm, wq, wkv, wkv, rope, rope), "norm_qkv_rope"),
             (lambda *t: gpu.norm_swiglu_gpu(*t, eps=EPS, block_d=block_d),
              (x, norm, w_up, w_up), "norm_swiglu"),
             (lambda *t: gpu.matmul_residual_gpu(*t, block_d=block_d),
              (a, w_down, x), "matmul_residual")]
    for fn, args, name in calls:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text and name in text


def _steps_apart(got, want, dtype=jnp.bfloat16):
    """|got - want| in units of the dtype's spacing at each row's largest |want| (a sum
    near zero, e.g. a RoPE difference, keeps the rounding error of its terms)."""
    scale = np.max(np.abs(_f64(want)), axis=-1, keepdims=True)
    return np.abs(_f64(got) - _f64(want)) / (float(jnp.finfo(dtype).eps) * scale)


@pytest.mark.parametrize("rows", [1, 19])
def test_bf16_kernels_round_like_the_reference(rows):
    """bf16 activations and weights: each output within 2 bf16 steps (at its row's
    scale) of the reference's: float32 sums in another order may round the other way."""
    i = _inputs(rows, dtype="bfloat16")
    for got, want in zip(_all_outputs(i, **INTERPRET), _all_outputs(i, implementation="xla")):
        assert got.dtype == jnp.bfloat16
        assert np.max(_steps_apart(got, want)) <= 2


def test_bad_shapes_are_named():
    i = _inputs(3)
    with pytest.raises(ValueError, match="cos and sin"):
        norm_qkv_rope(i["x"], i["norm"], i["wq"], i["wk"], i["wv"], i["cos"][:2], i["sin"],
                      eps=EPS)
    with pytest.raises(ValueError, match="q_norm and k_norm go together"):
        norm_qkv_rope(i["x"], i["norm"], i["wq"], i["wk"], i["wv"], i["cos"], i["sin"],
                      i["q_norm"], eps=EPS)
    with pytest.raises(ValueError, match="whole heads"):
        norm_qkv_rope(i["x"], i["norm"], i["wq"][:100], i["wk"], i["wv"], i["cos"], i["sin"],
                      eps=EPS)
    with pytest.raises(ValueError, match=r"w_gate must be \[out, 96\]"):
        norm_swiglu(i["x"], i["norm"], i["wg"][:, :50], i["wu"], eps=EPS)
    with pytest.raises(ValueError, match="residual must be"):
        matmul_residual(i["a"], i["wd"], i["x"][:2])
    with pytest.raises(ValueError, match="dtype"):
        matmul_residual(i["a"], i["wd"].astype(jnp.bfloat16), i["x"])


# ----- the target's layers ---------------------------------------------------------------
LLAMA = TargetConfig(family="llama", vocab_size=61, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, max_position_embeddings=256, tie_word_embeddings=True)
QWEN3 = TargetConfig(family="qwen3", vocab_size=61, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, max_position_embeddings=256, tie_word_embeddings=True)
FUSED = FusedLayers(**INTERPRET)


def _target(config, seed=0):
    model = TargetModel(config, rngs=nnx.Rngs(seed))
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if var[...].ndim == 1:      # norms other than all-ones
            var[...] = 1 + 0.3 * jax.random.normal(jax.random.key(seed + 7), var.shape)
    return model


@pytest.mark.parametrize("config", [LLAMA, QWEN3], ids=["llama", "qwen3"])
@pytest.mark.parametrize("rows,tokens", [(2, 1), (1, 5)], ids=["decode", "verify"])
def test_fused_target_step_matches_xla_layers(config, rows, tokens):
    """Prompts prefilled by XLA's layers, then a decode step of two rows or a 5-token
    verification block of one row with fused layers: the same logits and pages."""
    model = _target(config)
    page_table = jnp.arange(2 * rows, dtype=jnp.int32).reshape(rows, 2)
    cache = PagedKVCache.create(config, page_table, 2 * rows, page_size=16,
                                dtype=jnp.float32)
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, 61, (rows, 9)), jnp.int32)
    cache = model(prompt, cache).cache
    block = prompt[:, :tokens]
    want = model(block, cache)
    got = model(block, cache, layer_kernels=FUSED)
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    for g, w in zip(got.cache.k_pages + got.cache.v_pages,
                    want.cache.k_pages + want.cache.v_pages):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.cache.lengths, want.cache.lengths)


def test_fused_layers_leave_large_calls_to_xla():
    """A call of more rows than max_rows (a prefill chunk) traces no fused kernel."""
    model = _target(LLAMA)
    page_table = jnp.asarray([[0, 1]], jnp.int32)
    cache = PagedKVCache.create(LLAMA, page_table, 2, page_size=16, dtype=jnp.float32)
    tokens = jnp.zeros((1, 17), jnp.int32)

    def traced(t):
        return str(jax.make_jaxpr(lambda c: model(t, c, layer_kernels=FUSED).logits)(cache))

    assert "norm_qkv_rope" not in traced(tokens)
    assert "norm_qkv_rope" in traced(tokens[:, :4])


def test_decoder_with_fused_layers_gives_ar_tokens():
    """Greedy AR through fused layers equals AR through XLA's layers, and the runtime
    record says which ran."""
    model = _target(LLAMA, seed=3)
    prompts = [[5, 9, 11], [7, 2, 30, 41, 8, 1]]
    plain = AutoregressiveGenerator(model, eos_token_ids=[0], steps_per_call=4)
    fused = AutoregressiveGenerator(model, eos_token_ids=[0], steps_per_call=4,
                                    layer_kernels=FUSED)
    want = generate_tokens(plain, prompts, max_new_tokens=10, ignore_eos=True).generations
    got = generate_tokens(fused, prompts, max_new_tokens=10, ignore_eos=True).generations
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert RuntimeConfig.of(fused).layer_kernels == "fused"
    assert RuntimeConfig.of(plain).layer_kernels == "xla"


def test_layer_kernel_choice_is_checked():
    with pytest.raises(ConfigError, match="layer_kernels must be one of"):
        select_layer_kernels("fast", LLAMA)
    if jax.default_backend() != "gpu":
        with pytest.raises(ConfigError, match="CUDA GPUs"):
            select_layer_kernels("fused", LLAMA)
    biased = TargetConfig(**{**LLAMA.__dict__, "attention_bias": True})
    assert "biased" in FusedLayers.unsupported(biased)
    assert select_layer_kernels("xla", LLAMA) is None


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_gpu_kernels_compile_and_match(rows):
    i = _inputs(rows, d=576, heads=9, kv_heads=3, head_dim=64, f=1536, dtype="bfloat16")
    for got, want in zip(_all_outputs(i, implementation="pallas_gpu"),
                         _all_outputs(i, implementation="xla")):
        assert np.max(_steps_apart(got, want)) <= 2


def test_kernel_benchmark_runs_each_tile_choice(tmp_path):
    """benchmarks/decode_layer_kernels.py (interpret mode, one SmolLM2-shaped layer): a row
    per tile choice beside XLA's, whose output it matches."""
    from dspine_benchmarks import decode_layer_kernels

    out = tmp_path / "rows.jsonl"
    rows = decode_layer_kernels.main(["--rows", "1", "--layers", "1", "--repeats", "1",
                                      "--tiles", "128,16,4,2", "--dtype", "float32",
                                      "--interpret", "--out", str(out)])
    assert [r["tiles"] for r in rows] == ["xla", "128,16,4,2"]
    assert rows[1]["max_abs_diff"] < 1e-4 and rows[0]["x_xla"] == 1.0
    assert len(out.read_text().splitlines()) == 2
