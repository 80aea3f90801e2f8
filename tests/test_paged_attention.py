"""Paged KV cache and attention backends: the page pool's bookkeeping, and the xla and
pallas backends (the ragged paged attention kernel, in Pallas interpret mode on the CPU)
against an uncached dense forward, with NaN in every page nothing may read; speculative
decoding on the pallas backend equals AR greedy decoding.

Models here use head dim 64, the smallest the kernel supports.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dspine_jax.attention.backend as backend_module
from dspine_jax.attention import (AttentionMetadata, PallasBackend, XlaBackend,
                                  select_backend)
from dspine_jax.config import TargetConfig
from dspine_jax.drafters.config import DrafterConfig, DSpineConfig
from dspine_jax.drafters.model import BlockDrafter
from dspine_jax.engine import SpeculativeEngine
from dspine_jax.errors import ConfigError
from dspine_jax.generate import AutoregressiveGenerator
from dspine_jax.kv_cache import PagedKVCache
from dspine_jax.page_pool import OutOfPagesError, PagePool
from dspine_jax.target import TargetModel
from dspine_jax.runtime.offline import generate_tokens

CONFIG = TargetConfig(family="qwen3", vocab_size=61, hidden_size=64, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=256)
PS = 16
BACKENDS = {"xla": XlaBackend(), "pallas": PallasBackend()}


def sharpen(model, scale):
    """Scale the matrices so greedy choices are decisive (mistakes change tokens)."""
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if var[...].ndim == 2:
            var[...] = var[...] * scale
    return model


@pytest.fixture(scope="module")
def target():
    return sharpen(TargetModel(CONFIG, rngs=nnx.Rngs(0)), 6.0)


# ----- the page pool --------------------------------------------------------------------------
def test_pool_allocates_grows_rolls_back_and_frees():
    pool = PagePool(8, page_size=4)
    assert pool.allocate("a", 5) == [0, 1]           # 5 positions: 2 pages
    assert pool.allocate("b", 4) == [2]
    assert pool.allocate("a", 9) == [0, 1, 3]        # grows in place, order kept
    assert pool.allocate("a", 3) == [0, 1, 3]        # never shrinks on allocate
    pool.rollback("a", 4)                            # positions 0..3: one page
    assert pool.pages("a") == [0] and pool.num_free == 6
    pool.rollback("a", 4)
    assert pool.pages("a") == [0]
    table = pool.page_table(["a", "b", "c"], width=3)
    assert table.tolist() == [[0, 8, 8], [2, 8, 8], [8, 8, 8]]   # 8 = P: out of range
    pool.free("a")
    pool.free("b")
    assert pool.num_free == 8 and pool.pages("a") == []


def test_running_out_of_pages_names_the_pool_size():
    pool = PagePool(3, page_size=16)
    pool.allocate(0, 40)
    with pytest.raises(OutOfPagesError, match="pool's 3 pages"):
        pool.allocate(1, 17)
    assert pool.pages(1) == [] and pool.num_free == 0  # a failed allocation takes nothing


# ----- backends against a dense uncached forward ------------------------------------------------
def shuffled_cache(config, batch, capacity, seed, fill=np.nan):
    """Rows own pages in a random order, among spare pages no row owns; every slot NaN."""
    width = -(-capacity // PS)
    num_pages = batch * width + 3
    ids = np.random.default_rng(seed).permutation(num_pages)[:batch * width]
    return PagedKVCache.create(config, ids.reshape(batch, width).astype(np.int32), num_pages,
                               page_size=PS, fill=fill)


def dense_logits(model, rows, pad_to=48):
    """Each row alone, uncached (right padding changes nothing before it): the reference."""
    graph, state = nnx.split(model)
    run = jax.jit(lambda tokens: nnx.merge(graph, state)(tokens).logits)
    return [np.asarray(run(jnp.asarray([r + [0] * (pad_to - len(r))]))[0, :len(r)])
            for r in rows]


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_prefill_decode_verify_equal_a_dense_forward_over_nan_pages(target, backend):
    """Ragged prefill, three decode steps, a 5-token verify rolled back by 2, a decode:
    logits equal the uncached forward; NaN pages (unused, and past each length) never leak."""
    graph, state = nnx.split(target)
    run = jax.jit(lambda tokens, cache, metadata: nnx.merge(graph, state)(
        tokens, cache, metadata=metadata, attention=BACKENDS[backend]))
    rng = np.random.default_rng(1)
    lengths = [5, 17, 1]
    seqs = [rng.integers(2, 61, size=40).tolist() for _ in lengths]
    cache = shuffled_cache(CONFIG, 3, 64, seed=2)
    prompts = np.zeros((3, 32), np.int32)
    for i, n in enumerate(lengths):
        prompts[i, :n] = seqs[i][:n]
    md = AttentionMetadata.paged(cache.lengths, cache.page_table, 32,
                                 q_lens=jnp.asarray(lengths, jnp.int32))
    out = run(jnp.asarray(prompts), cache, md)
    got = [[np.asarray(out.logits[i, :n])] for i, n in enumerate(lengths)]
    cache = out.cache
    pos = list(lengths)
    for _ in range(3):   # decode
        step = jnp.asarray([[s[p]] for s, p in zip(seqs, pos)])
        out = run(step, cache, None)
        cache = out.cache
        for i in range(3):
            got[i].append(np.asarray(out.logits[i]))
        pos = [p + 1 for p in pos]
    # verify: 3 true tokens, then 2 wrong ones that the rollback must forget
    block = jnp.asarray([s[p:p + 3] + [0, 0] for s, p in zip(seqs, pos)])
    out = run(block, cache, None)
    for i in range(3):
        got[i].append(np.asarray(out.logits[i, :3]))     # 3 "accepted"
    cache = out.cache.rollback(out.cache.lengths - 2)
    pos = [p + 3 for p in pos]
    out = run(jnp.asarray([[s[p]] for s, p in zip(seqs, pos)]), cache, None)  # after rollback
    for i in range(3):
        got[i].append(np.asarray(out.logits[i]))
    for i, want in enumerate(dense_logits(target, [s[:p + 1] for s, p in zip(seqs, pos)])):
        g = np.concatenate(got[i])
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_draft_block_backends_agree_with_training_forward(target, kind):
    """The paged block (causal for DSpine, bidirectional for DFlash) on either backend
    equals the dense block-diagonal training forward; the block is written past the
    context and the context's length does not move."""
    drafter = make_drafter(target, kind)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(2, 61, size=(2, 24)))
    feats = jax.jit(lambda t: target(t, hidden_layer_ids=drafter.config.target_layer_ids)
                    .features())(tokens)
    anchors = jnp.asarray([[7], [18]])
    train = drafter.forward_train(tokens, feats, anchors, target.input_embedding(),
                                  target.output_embedding())
    for name, backend in BACKENDS.items():
        ctx = shuffled_cache(drafter.config.layer_config(), 2, 32, seed=4)
        ctx = drafter.extend_context(ctx, feats, anchors[:, 0], attention=backend)
        out = drafter.draft_block(tokens[jnp.arange(2), anchors[:, 0]], ctx,
                                  target.input_embedding(), target.output_embedding(),
                                  attention=backend)
        assert out.context.lengths.tolist() == [7, 18], name
        k_dense, _ = out.context.dense(0)
        assert np.isfinite(np.asarray(k_dense[0, :7 + K])).all()   # block written at 7..
        np.testing.assert_allclose(out.logits[:, 0], train.logits[:, 0], rtol=2e-4,
                                   atol=2e-4, err_msg=name)


# ----- speculative decoding on the kernel -------------------------------------------------
K = 5
PROMPTS = [np.random.default_rng(i).integers(2, 61, size=n).tolist()
           for i, n in enumerate([3, 17, 9, 1])]


def make_drafter(target, kind):
    spine = DSpineConfig(transfer_rank=16, message_size=8, top_k=6) if kind == "dspine" else None
    config = DrafterConfig.for_target(CONFIG, kind=kind, num_layers=2, mask_token_id=1,
                                      block_size=K, num_features=1, dspine=spine)
    drafter = BlockDrafter.create(config, target.output_embedding(), seed=1)
    if kind == "dspine":
        for write in drafter.injection.writes:
            write.weight[...] = jax.random.normal(jax.random.key(2), write.weight.shape) * 0.3
    return drafter


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_greedy_speculative_on_pallas_equals_autoregressive(target, kind):
    want = generate_tokens(AutoregressiveGenerator(target, eos_token_ids=[0],
                                                   attention_backend="xla"),
                           PROMPTS, max_new_tokens=24).generations
    engine = SpeculativeEngine(target, make_drafter(target, kind), eos_token_ids=[0],
                               steps_per_call=3, attention_backend="pallas")
    assert isinstance(engine.attention, PallasBackend)
    got = generate_tokens(engine, PROMPTS, max_new_tokens=24).generations
    for w, g in zip(want, got):
        assert g.tokens == w.tokens and g.finish_reason == w.finish_reason
        assert sum(g.accept_lengths) == len(g.tokens) - 1


def test_sampled_speculative_on_pallas_equals_xla(target):
    """Seeded sampling draws the same tokens on both backends, so the chi-square tests of
    test_engine.py (run on xla: 12000 rows are too many for interpret mode) cover pallas."""
    drafter = make_drafter(target, "dspine")
    runs = [generate_tokens(SpeculativeEngine(target, drafter, eos_token_ids=[], steps_per_call=4,
                              attention_backend=name),
        PROMPTS[:2], max_new_tokens=16, temperature=1.0, seed=5).generations
        for name in ("xla", "pallas")]
    assert [g.tokens for g in runs[0]] == [g.tokens for g in runs[1]]
    assert [g.accept_lengths for g in runs[0]] == [g.accept_lengths for g in runs[1]]


def test_autoregressive_on_pallas_equals_xla(target):
    kw = dict(eos_token_ids=[], steps_per_call=8)
    want = generate_tokens(AutoregressiveGenerator(target, attention_backend="xla", **kw),
        PROMPTS, max_new_tokens=20).generations
    got = generate_tokens(AutoregressiveGenerator(target, attention_backend="pallas", **kw),
        PROMPTS, max_new_tokens=20).generations
    assert [g.tokens for g in got] == [w.tokens for w in want]


# ----- choosing a backend ------------------------------------------------------------------------
ODD = TargetConfig(family="llama", vocab_size=61, hidden_size=48, intermediate_size=64,
                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=12, max_position_embeddings=64)


def test_explicit_pallas_refuses_what_the_kernel_cannot_run():
    with pytest.raises(ConfigError, match=r"head dim 12 \(supported: 64, 128\)"):
        select_backend("pallas", [ODD], dtype=jnp.float32, page_size=16)
    with pytest.raises(ConfigError, match=r"page size 4 \(supported: 8, 16"):
        select_backend("pallas", [CONFIG], dtype=jnp.float32, page_size=4)
    with pytest.raises(ConfigError, match="one of auto, pallas, xla"):
        select_backend("flash", [CONFIG], dtype=jnp.float32, page_size=16)


def test_auto_falls_back_to_xla_with_one_warning(monkeypatch):
    monkeypatch.setattr(backend_module, "default_backend_name", lambda: "pallas")
    monkeypatch.setattr(backend_module, "_warned", set())
    assert isinstance(select_backend("auto", [CONFIG], dtype=jnp.float32, page_size=16),
                      PallasBackend)
    with pytest.warns(UserWarning, match="head dim 12.*falling back to the xla"):
        chosen = select_backend("auto", [ODD], dtype=jnp.float32, page_size=16)
    assert isinstance(chosen, XlaBackend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the second time: no warning
        select_backend("auto", [ODD], dtype=jnp.float32, page_size=16)
