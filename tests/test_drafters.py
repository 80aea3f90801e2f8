"""DFlash and DSpine drafters: shapes, masks, train/inference agreement, DSpine's pieces."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspine_jax.config import PRESETS, TargetConfig
from dspine_jax.drafters.blocks import training_mask
from dspine_jax.drafters.config import DrafterConfig, DSpineConfig, build_target_layer_ids
from dspine_jax.drafters.model import BlockDrafter
from dspine_jax.drafters.transfer import build_transfer_space
from dspine_jax.errors import ConfigError
from dspine_jax.target import TargetModel

TARGET = TargetConfig(family="qwen3", vocab_size=97, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=128)
SPINE = DSpineConfig(transfer_rank=32, message_size=16, top_k=4)
K = 4


@pytest.fixture(scope="module")
def target():
    return TargetModel(TARGET, rngs=nnx.Rngs(0))


def make(target, kind, seed=1, **spine):
    config = DrafterConfig.for_target(TARGET, kind=kind, num_layers=2, mask_token_id=3,
                                      block_size=K, dspine=dataclasses.replace(SPINE, **spine))
    drafter = BlockDrafter.create(config, target.output_embedding(), seed=seed)
    if kind == "dspine":  # give the writes weight so injection actually does something
        for write in drafter.injection.writes:
            write.weight[...] = jax.random.normal(jax.random.key(seed), write.weight.shape) * 0.3
    return drafter


def features(target, drafter, tokens):
    out = target(tokens, hidden_layer_ids=drafter.config.target_layer_ids)
    return jnp.concatenate(list(out.hidden_states), -1)


def train_logits(target, drafter, tokens, feats, anchors):
    return drafter.forward_train(tokens, feats, anchors, target.input_embedding(),
                                 target.output_embedding()).logits


TOKENS = jax.random.randint(jax.random.key(7), (2, 24), 0, 97)
ANCHORS = jnp.asarray([[2, 9, 15], [0, 6, 19]])


def test_target_layer_ids_follow_dflash():
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B, from the paper
    assert build_target_layer_ids(30, 5) == (1, 8, 14, 20, 27)  # SmolLM2
    config = DrafterConfig.for_target(PRESETS["qwen3-8b"], kind="dflash", mask_token_id=0)
    assert config.target_layer_ids == (1, 9, 17, 25, 33) and config.num_features == 5


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_training_and_inference_forwards_agree(target, kind):
    """Block j of the training pass == drafting that block against a context cache
    holding the features of every position before its anchor."""
    drafter = make(target, kind)
    feats = features(target, drafter, TOKENS)
    out = drafter.forward_train(TOKENS, feats, ANCHORS, target.input_embedding(),
                                target.output_embedding())
    assert out.logits.shape == (2, 3, K, 97) and out.hidden.shape == (2, 3, K, 64)
    if kind == "dspine":
        assert out.features.shape == (2, 2, 3, K, 32) and out.gates.shape == (2,)
    for j in range(3):
        a = ANCHORS[:, j]
        ctx = drafter.create_context(2, 32)
        ctx = drafter.extend_context(ctx, feats, a)  # rows keep only their first a[b] entries
        block = drafter.draft_block(TOKENS[jnp.arange(2), a], ctx, target.input_embedding(),
                                    target.output_embedding())
        np.testing.assert_allclose(block.logits[:, 0], out.logits[:, j], rtol=1e-5, atol=1e-5)


def test_a_causal_block_drafted_in_part_equals_the_whole_blocks_first_positions(target):
    """DSpine drafts only as far as a narrower verify reaches: every output of its first
    positions (logits, hidden, the transition cache, injection features) equals the
    whole block's; DFlash's bidirectional block refuses."""
    drafter = make(target, "dspine")
    feats = features(target, drafter, TOKENS)
    ctx = drafter.extend_context(drafter.create_context(2, 32), feats, jnp.asarray([9, 13]))
    args = (TOKENS[jnp.arange(2), jnp.asarray([9, 13])], ctx, target.input_embedding(),
            target.output_embedding())
    whole = drafter.draft_block(*args)
    for positions in (2, 3):
        part = drafter.draft_block(*args, positions=positions)
        assert part.logits.shape == (2, 1, positions, 97)
        for name in ("logits", "hidden", "pre_injection"):
            np.testing.assert_allclose(getattr(part, name),
                                       getattr(whole, name)[:, :, :positions],
                                       rtol=1e-5, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(part.features, whole.features[:, :, :, :positions],
                                   rtol=1e-5, atol=1e-5)
    for bad in (1, K + 1):
        with pytest.raises(ValueError, match="positions must be in"):
            drafter.draft_block(*args, positions=bad)
    with pytest.raises(ValueError, match="bidirectional"):
        make(target, "dflash").draft_block(*args, positions=2)


def test_context_cache_extends_incrementally(target):
    drafter = make(target, "dspine")
    feats = features(target, drafter, TOKENS)
    whole = drafter.extend_context(drafter.create_context(2, 32), feats[:, :12],
                                   jnp.asarray([12, 12]))
    parts = drafter.create_context(2, 32)
    for lo, hi in [(0, 5), (5, 6), (6, 12)]:
        parts = drafter.extend_context(parts, feats[:, lo:hi], jnp.asarray([hi - lo] * 2))
    a = jnp.asarray([12, 12])
    one = drafter.draft_block(TOKENS[:, 12], whole, target.input_embedding(),
                              target.output_embedding())
    two = drafter.draft_block(TOKENS[:, 12], parts, target.input_embedding(),
                              target.output_embedding())
    np.testing.assert_allclose(one.logits, two.logits, rtol=1e-5, atol=1e-5)
    assert whole.lengths.tolist() == a.tolist()


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_block_sees_only_context_before_its_anchor(target, kind):
    drafter = make(target, kind)
    feats = features(target, drafter, TOKENS)
    base = train_logits(target, drafter, TOKENS, feats, ANCHORS)
    row, j = 0, 1                          # block at anchor 9 of row 0
    a = int(ANCHORS[row, j])
    later = feats.at[row, a:].add(1.0)     # features at and after the anchor
    moved = train_logits(target, drafter, TOKENS, later, ANCHORS)
    np.testing.assert_array_equal(moved[row, j], base[row, j])
    np.testing.assert_array_equal(moved[row, 0], base[row, 0])  # earlier block too
    assert not np.allclose(moved[row, 2], base[row, 2])         # a later block does see them
    before = feats.at[row, a - 1].add(1.0)  # the position just before the anchor is seen
    assert not np.allclose(train_logits(target, drafter, TOKENS, before, ANCHORS)[row, j],
                           base[row, j])
    # Another block's anchor token is invisible; this block's own anchor is not.
    other = TOKENS.at[row, int(ANCHORS[row, 2])].set((TOKENS[row, int(ANCHORS[row, 2])] + 1) % 97)
    np.testing.assert_array_equal(train_logits(target, drafter, other, feats, ANCHORS)[row, j],
                                  base[row, j])
    own = TOKENS.at[row, a].set((TOKENS[row, a] + 1) % 97)
    assert not np.allclose(train_logits(target, drafter, own, feats, ANCHORS)[row, j],
                           base[row, j])


@pytest.mark.parametrize("causal", [True, False])
def test_block_attention_mask(target, causal):
    visible = jnp.asarray([[[True, False]] * 2])     # [1, n=2, S=2]
    mask = np.asarray(training_mask(visible, K, causal))  # [1, 2K, 2 + 2K]
    block = mask[0, :, 2:]
    for qi in range(2 * K):
        for ki in range(2 * K):
            same = qi // K == ki // K
            expected = same and (ki % K <= qi % K if causal else True)
            assert block[qi, ki] == expected
    assert mask[0, :, 0].all() and not mask[0, :, 1].any()
    assert not make(target, "dflash").config.causal_block


def test_fresh_dspine_with_bidirectional_block_is_dflash(target):
    """Zero writes: a fresh DSpine computes exactly DFlash's backbone logits."""
    dflash = BlockDrafter.create(DrafterConfig.for_target(
        TARGET, kind="dflash", num_layers=2, mask_token_id=3, block_size=K), seed=5)
    spine_config = DrafterConfig.for_target(
        TARGET, kind="dspine", num_layers=2, mask_token_id=3, block_size=K,
        dspine=dataclasses.replace(SPINE, causal_block=False))
    dspine = BlockDrafter.create(spine_config, target.output_embedding(), seed=5)
    for write in dspine.injection.writes:
        assert not np.any(write.weight[...])
    assert not np.any(dspine.injection.predecessor_gate.weight[...])
    assert not np.any(dspine.injection.bias[...])
    feats = features(target, dflash, TOKENS)
    np.testing.assert_array_equal(train_logits(target, dspine, TOKENS, feats, ANCHORS),
                                  train_logits(target, dflash, TOKENS, feats, ANCHORS))


def test_injection_conditions_successors_on_predecessors(target):
    """With non-zero writes, slot 2 depends on the anchor's code path through slot 1."""
    drafter = make(target, "dspine")
    feats = features(target, drafter, TOKENS)
    a = jnp.asarray([[9], [9]])
    replace = jnp.asarray([[True], [False]])
    out = drafter.forward_train(TOKENS, feats, a, target.input_embedding(),
                                target.output_embedding(), replace=replace, replace_layers=3)
    plain = drafter.forward_train(TOKENS, feats, a, target.input_embedding(),
                                  target.output_embedding())
    # Teacher replacement changes the replaced block (slots >= 2) and only it.
    assert not np.allclose(out.logits[0, 0, 2:], plain.logits[0, 0, 2:])
    np.testing.assert_array_equal(out.logits[1], plain.logits[1])
    np.testing.assert_array_equal(out.logits[0, 0, :2], plain.logits[0, 0, :2])


def reference_transfer(e_out, rank):
    e = e_out / np.linalg.norm(e_out, axis=1, keepdims=True)
    mu = e.mean(0)
    cov = (e - mu).T @ (e - mu) / len(e)
    lam, vec = np.linalg.eigh(cov)
    idx = np.argsort(lam)[::-1][:rank]
    z = (e - mu) @ vec[:, idx] / np.sqrt(lam[idx])
    return z, vec[:, idx]


def test_transfer_codes_are_whitened_unit_vectors():
    e_out = np.random.default_rng(0).normal(size=(500, 24)) @ np.diag(np.linspace(0.2, 3, 24))
    space = build_transfer_space(e_out, 10, chunk=128)  # several chunks
    z, d = reference_transfer(e_out.astype(np.float64), 10)
    codes = space.codes(e_out)
    np.testing.assert_allclose(np.linalg.norm(codes, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.cov(z.T, bias=True), np.eye(10), atol=1e-8)  # whitened
    expected = z / np.linalg.norm(z, axis=1, keepdims=True)
    signs = np.sign(np.sum(space.projection.T * d, axis=0))  # eigenvectors up to sign
    np.testing.assert_allclose(codes, expected * signs, atol=2e-4)
    with pytest.raises(ConfigError, match="rank 30 exceeds the hidden size 24"):
        build_transfer_space(e_out, 30)
    flat = np.repeat(e_out[:, :3], 8, axis=1)  # rank-3 rows
    with pytest.raises(ConfigError, match="positive eigenvalues"):
        build_transfer_space(flat, 10)


def test_readouts_start_at_the_transfer_projection(target):
    drafter = make(target, "dspine")
    space = build_transfer_space(target.output_embedding(), 32)
    for readout in drafter.injection.readouts:
        np.testing.assert_allclose(readout.weight[...], space.projection, atol=1e-6)
    np.testing.assert_allclose(drafter.transfer_whiten[...], space.whiten, rtol=1e-6)
    # The drafter's code of a token is the table's row, computed from its lm_head row.
    tokens = jnp.arange(97)
    np.testing.assert_allclose(drafter.code(tokens, target.output_embedding()),
                               np.sqrt(32) * space.codes(target.output_embedding()), atol=1e-5)


def test_drafter_and_target_mismatch_is_named(target):
    config = make(target, "dflash").config
    other = dataclasses.replace(TARGET, hidden_size=32, head_dim=8)
    with pytest.raises(ConfigError, match="hidden_size is 64, the target's is 32"):
        config.check_target(other)
    with pytest.raises(ConfigError, match="vocab_size is 97, the target's is 120"):
        config.check_target(dataclasses.replace(TARGET, vocab_size=120))
    with pytest.raises(ConfigError, match="num_target_layers is 6, the target's is 4"):
        config.check_target(dataclasses.replace(TARGET, num_hidden_layers=4))
    with pytest.raises(ConfigError, match="target_layer_ids \\[9\\] out of range"):
        dataclasses.replace(config, target_layer_ids=(1, 9))
    with pytest.raises(ConfigError, match="mask_token_id 97 is outside"):
        dataclasses.replace(config, mask_token_id=97)
    with pytest.raises(ConfigError, match="transfer_rank \\(128\\) must not exceed"):
        DrafterConfig.for_target(TARGET, kind="dspine", mask_token_id=3,
                                 dspine=DSpineConfig(transfer_rank=128))


def test_einsum_f32_gradients_run_in_the_operands_dtype():
    """Forward: the float32-accumulated einsum itself. Backward: bf16 gradients (XLA would
    otherwise run both gradient matmuls in float32), equal to float64 autodiff within bf16
    rounding."""
    from dspine_jax.layers import einsum_f32

    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 5, 8)).astype(np.float32)
    b = rng.standard_normal((7, 8)).astype(np.float32)
    g = rng.standard_normal((3, 5, 7)).astype(np.float32)
    a16, b16 = jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)
    out, vjp = jax.vjp(lambda x, y: einsum_f32("TQD,VD->TQV", x, y), a16, b16)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, jnp.einsum("TQD,VD->TQV", a16, b16,
                                                  preferred_element_type=jnp.float32))
    da, db = vjp(jnp.asarray(g))
    assert da.dtype == db.dtype == jnp.bfloat16
    a64, b64, g64 = (np.asarray(x, np.float64) for x in (a16, b16, g))
    np.testing.assert_allclose(np.asarray(da, np.float64), np.einsum("TQV,VD->TQD", g64, b64),
                               rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(np.asarray(db, np.float64), np.einsum("TQV,TQD->VD", g64, a64),
                               rtol=3e-2, atol=6e-2)
    # float32 operands: exactly float32 autodiff
    ref = jax.grad(lambda x: jnp.sum(jnp.einsum("TQD,VD->TQV", x, b) * g))(a)
    np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(einsum_f32("TQD,VD->TQV", x, b) * g))(a),
                               ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_logit_lens_reads_each_layer_through_the_final_norm_and_lm_head(target, kind):
    """keep_layers returns every layer's output (the last, normed, is the base head's
    hidden state); the diagnostics' logit lens of each layer equals a float64 RMSNorm and
    lm_head over it, and its last layer is the base head's argmax."""
    from dspine_benchmarks.drafter_diagnostics import logit_lens
    drafter = make(target, kind)
    # a norm weight that reorders the logits: a lens that skips the norm must fail
    drafter.norm.weight[...] = jax.random.normal(jax.random.key(3), (64,))
    feats = features(target, drafter, TOKENS)
    e_out = target.output_embedding()
    args = (TOKENS, feats, ANCHORS, target.input_embedding(), e_out)
    assert drafter.forward_train(*args).layers is None
    out = drafter.forward_train(*args, keep_layers=True)
    assert out.layers.shape == (2, 2, 3, K, 64)
    np.testing.assert_allclose(drafter.norm(out.layers[-1]), out.hidden, rtol=1e-5, atol=1e-5)
    lens = logit_lens(drafter, out, e_out)                          # row 0: [L, n, K-1]
    h = np.asarray(out.layers[:, 0, :, 1:], np.float64)
    normed = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + drafter.norm.eps)
    normed = normed * np.asarray(drafter.norm.weight[...], np.float64)
    want = np.argmax(normed @ np.asarray(e_out, np.float64).T, -1)
    np.testing.assert_array_equal(lens, want)
    np.testing.assert_array_equal(lens[-1], np.argmax(np.asarray(out.logits[0, :, 1:]), -1))
    if kind == "dspine":    # injection moves the layers apart (a lens that reads one fails)
        assert (lens[0] != lens[-1]).any()
