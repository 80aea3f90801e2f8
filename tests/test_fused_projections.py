"""Fused projections (`fuse_projections`): q/k/v and gate/up as one GEMM each, what every
decoder runs. The fused model must compute the unfused one's function of the same
weights, save and export the same tensors under the same names, and leave XLA no weights
to concatenate: one dot per layer where there were three (q, k, v) and two (gate, up)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspine_jax.checkpoints.params import export_tensors
from dspine_jax.drafters.checkpoint import drafter_tensors, load_drafter, save_drafter
from dspine_jax.engine import SpeculativeEngine
from dspine_jax.generate import AutoregressiveGenerator
from dspine_jax.target import TargetModel
from tests.test_drafters import TARGET, TOKENS, features, make

# One dot over stacked weights sums in another order than separate dots: float32 values
# of order 1 then differ by a few ulps (up to 1.1e-6 seen on a 2-core x86 CPU).
SAME = dict(rtol=1e-5, atol=1e-5)


def fresh_target(seed: int = 0) -> TargetModel:
    return TargetModel(TARGET, rngs=nnx.Rngs(seed))


def dots_per_forward(model: TargetModel) -> int:
    """dot_general ops in the lowered (not yet optimised) forward of a [2, 6] batch."""
    graph, state = nnx.split(model)
    text = jax.jit(lambda s, t: nnx.merge(graph, s)(t).logits).lower(
        state, TOKENS[:, :6]).as_text()
    return len(re.findall(r"stablehlo\.dot_general", text))


def test_fused_target_computes_the_same_function_with_fewer_dots():
    unfused, fused = fresh_target(), fresh_target()
    fused.fuse_projections()
    assert not hasattr(fused.layers[0].self_attn, "q_proj")
    assert fused.layers[0].self_attn.qkv_proj.weight.shape == (
        (TARGET.num_attention_heads + 2 * TARGET.num_key_value_heads) * TARGET.head_dim,
        TARGET.hidden_size)
    a = unfused(TOKENS, hidden_layer_ids=(1, 3))
    b = fused(TOKENS, hidden_layer_ids=(1, 3))
    np.testing.assert_allclose(b.logits, a.logits, **SAME)
    np.testing.assert_allclose(b.hidden_states, a.hidden_states, **SAME)
    # q, k, v -> one; gate, up -> one: 3 fewer dots per layer, attention's two unchanged
    assert dots_per_forward(unfused) - dots_per_forward(fused) == 3 * TARGET.num_hidden_layers


def test_fused_target_exports_the_unfused_tensors():
    unfused, fused = fresh_target(), fresh_target()
    fused.fuse_projections()
    fused.fuse_projections()          # idempotent
    want, got = export_tensors(unfused), export_tensors(fused)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_fused_drafter_drafts_the_same_block_and_saves_the_same_tensors(tmp_path, kind):
    target = fresh_target()
    unfused, fused = make(target, kind), make(target, kind)
    fused.fuse_projections()
    feats = features(target, unfused, TOKENS)
    lengths = jnp.asarray([9, 13])
    anchors = TOKENS[jnp.arange(2), lengths]
    e_in, e_out = target.input_embedding(), target.output_embedding()
    blocks = []
    for drafter in (unfused, fused):
        # extend_context projects the context alone (fused: context_kv_proj)
        ctx = drafter.extend_context(drafter.create_context(2, 32), feats, lengths)
        blocks.append(drafter.draft_block(anchors, ctx, e_in, e_out))
    np.testing.assert_allclose(blocks[1].logits, blocks[0].logits, **SAME)
    np.testing.assert_allclose(blocks[1].context.k_pages[1], blocks[0].context.k_pages[1],
                               **SAME)
    # training's forward runs the fused layers too
    np.testing.assert_allclose(
        fused.forward_train(TOKENS, feats, jnp.asarray([[2, 9], [0, 6]]), e_in, e_out).logits,
        unfused.forward_train(TOKENS, feats, jnp.asarray([[2, 9], [0, 6]]), e_in, e_out).logits,
        **SAME)
    want, got = drafter_tensors(unfused), drafter_tensors(fused)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    save_drafter(fused, tmp_path)
    reloaded = load_drafter(tmp_path, dtype=jnp.float32)
    for name, value in drafter_tensors(reloaded).items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_fused_drafter_projects_every_layers_context_in_one_dot(kind):
    target = fresh_target()
    unfused, fused = make(target, kind), make(target, kind)
    fused.fuse_projections()
    layers = len(fused.layers)
    kv_rows = 2 * TARGET.num_key_value_heads * TARGET.head_dim
    assert fused.context_kv_proj.weight.shape == (layers * kv_rows, TARGET.hidden_size)
    feats = features(target, unfused, TOKENS)
    positions = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)

    def dots(drafter):
        graph, state = nnx.split(drafter)
        text = jax.jit(lambda s, f: nnx.merge(graph, s).context_kvs(
            nnx.merge(graph, s).fuse(f), positions)).lower(state, feats).as_text()
        return len(re.findall(r"stablehlo\.dot_general", text))

    # the fc projection and one dot for the k/v of every layer, where there were 2 per layer
    assert dots(unfused) - dots(fused) == 2 * layers - 1
    want = unfused.context_kvs(unfused.fuse(feats), positions)
    got = fused.context_kvs(fused.fuse(feats), positions)
    for (k0, v0), (k1, v1) in zip(want, got, strict=True):
        np.testing.assert_allclose(k1, k0, **SAME)
        np.testing.assert_allclose(v1, v0, **SAME)


def test_decoders_fuse_the_models_they_run():
    target = fresh_target()
    drafter = make(target, "dspine")
    AutoregressiveGenerator(target)
    assert target.layers[0].self_attn.fused and target.layers[0].mlp.fused
    assert not drafter.layers[0].self_attn.fused
    engine = SpeculativeEngine(target, drafter)
    assert drafter.layers[0].self_attn.fused and drafter.layers[0].mlp.fused
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(engine.drafter_params)}
    assert "layers.0.self_attn.qkv_proj.weight" in names
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in names)
