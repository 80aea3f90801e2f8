"""Losses, schedules and metrics against float64 numpy references; gradient flow."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dspine_jax.drafters.blocks import (block_labels, sample_anchors, target_slot_hidden,
                                        target_slot_logits)
from dspine_jax.drafters.model import DraftOutput
from dspine_jax.errors import ConfigError
from dspine_jax.losses import (LossConfig, alignment_scale, drafter_loss, label_rank,
                               refinement_candidates, slot_metrics, slot_weights,
                               teacher_replacement_probability)
from tests.test_drafters import ANCHORS, K, TARGET, TOKENS, features, make


@pytest.fixture(scope="module")
def target():
    from dspine_jax.target import TargetModel

    return TargetModel(TARGET, rngs=nnx.Rngs(0))


def softmax64(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def rms_norm64(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def test_slot_weights_and_schedules():
    np.testing.assert_allclose(slot_weights(16, 7.0),
                               [0] + [math.exp(-(k - 1) / 7) for k in range(1, 16)], rtol=1e-6)
    p = [float(teacher_replacement_probability(x, 1 / 6, 1 / 3, 0.5))
         for x in (0.0, 0.1, 1 / 6, 0.25, 1 / 3, 0.6)]
    np.testing.assert_allclose(p, [0.5, 0.5, 0.5, 0.25, 0.0, 0.0], atol=1e-6)
    assert [float(alignment_scale(s, 0.5, 150)) for s in (0, 75, 150, 400)] == [0, 0.25, 0.5, 0.5]
    flash = LossConfig().resolve(make_config("dflash"))
    assert (flash.backbone, flash.refinement, flash.alignment, flash.teacher_replacement) == \
        ("ce", False, False, False)
    spine = LossConfig().resolve(make_config("dspine"))
    assert (spine.backbone, spine.refinement, spine.alignment, spine.alignment_weight,
            spine.gamma, spine.top_k) == ("ce+l1", True, True, 0.5, 7.0, 4)
    assert LossConfig(backbone="ce+l1").resolve(make_config("dflash")).backbone == "ce+l1"
    assert not LossConfig().resolved and spine.resolved


def make_config(kind):
    from dspine_jax.drafters.config import DrafterConfig
    from tests.test_drafters import SPINE

    return DrafterConfig.for_target(TARGET, kind=kind, mask_token_id=3, dspine=SPINE)


def test_block_labels_stop_at_the_first_non_response_slot():
    tokens = jnp.arange(12)[None]
    mask = jnp.asarray([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1]], bool)
    labels, sup = block_labels(tokens, mask, jnp.asarray([[1, 6, 9]]),
                               jnp.asarray([[True, True, False]]), 4)
    np.testing.assert_array_equal(labels[0, 0], [1, 2, 3, 4])
    np.testing.assert_array_equal(sup[0], [[0, 1, 1, 1],   # 2, 3, 4 are response tokens
                                           [0, 1, 1, 1],   # 7, 8, 9
                                           [0, 0, 0, 0]])  # invalid anchor
    _, sup = block_labels(tokens, mask, jnp.asarray([[3, 9, 10]]), jnp.ones((1, 3), bool), 4)
    np.testing.assert_array_equal(sup[0], [[0, 1, 0, 0],   # 5 is prompt: stop there
                                           [0, 1, 1, 0],   # runs off the sequence
                                           [0, 1, 0, 0]])


def test_sample_anchors_only_where_the_next_token_is_supervised():
    mask = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 0], [0, 1, 0, 0, 0, 0, 0, 0]], bool)
    anchors, valid = sample_anchors(jax.random.key(0), mask, 3)
    assert sorted(np.asarray(anchors[0]).tolist()) == np.asarray(anchors[0]).tolist()
    assert set(np.asarray(anchors[0]).tolist()) <= {2, 3, 4, 5} and valid[0].all()
    assert np.asarray(anchors[1][valid[1]]).tolist() == [0] and valid[1].sum() == 1


def test_target_slot_logits_read_the_position_before_each_slot(target):
    out = target(TOKENS)
    got = target_slot_logits(out.final_hidden, ANCHORS, K, target.output_embedding())
    for b in range(2):
        for j in range(3):
            for k in range(K):
                pos = min(max(int(ANCHORS[b, j]) + k - 1, 0), TOKENS.shape[1] - 1)
                np.testing.assert_allclose(got[b, j, k], out.logits[b, pos], rtol=1e-5, atol=1e-5)


def fake_output(seed, b=2, n=3, v=11):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(b, n, K, v)).astype(np.float32) * 2
    return DraftOutput(logits=jnp.asarray(logits), hidden=None, pre_injection=None,
                       features=None, gates=None), rng


@pytest.mark.parametrize("backbone", ["ce", "ce+l1"])
def test_backbone_loss_matches_reference(backbone):
    out, rng = fake_output(0)
    labels = rng.integers(0, 11, size=(2, 3, K))
    sup = rng.random((2, 3, K)) > 0.3
    sup[..., 0] = False
    target_logits = rng.normal(size=(2, 3, K, 11)).astype(np.float32)
    config = LossConfig(gamma=3.0, backbone=backbone, ce_weight=0.1, refinement=False,
                        top_k=16, alignment=False, logits="dense")
    loss, metrics = drafter_loss(config, None, out, jnp.asarray(labels), jnp.asarray(sup),
                                 target_logits=jnp.asarray(target_logits))
    q = softmax64(out.logits)
    ce = -np.log(np.take_along_axis(q, labels[..., None], -1)[..., 0])
    per = ce if backbone == "ce" else 0.1 * ce + 0.9 * np.abs(q - softmax64(target_logits)).sum(-1)
    w = np.where(np.arange(K) >= 1, np.exp(-(np.arange(K) - 1) / 3.0), 0) * sup
    assert float(loss) == pytest.approx((per * w).sum() / w.sum(), rel=1e-5)
    assert float(metrics["backbone_ce"]) == pytest.approx((ce * w).sum() / w.sum(), rel=1e-5)


def test_slot_metrics_on_a_hand_built_block():
    labels = jnp.asarray([[[0, 1, 2, 3], [0, 1, 2, 3]]])
    predicted = np.asarray([[[0, 1, 2, 0], [0, 1, 0, 3]]])     # prefixes 3 and 2 (bonus incl.)
    sup = jnp.asarray([[[0, 1, 1, 1], [0, 1, 1, 1]]], bool)
    m = slot_metrics(jnp.asarray(predicted) == labels, sup)
    np.testing.assert_allclose(m["slot_accuracy"], [1, 1, 0.5, 0.5])
    assert float(m["accept_len_blocks"]) == pytest.approx((3 + 2) / 2)
    assert float(m["accept_len_estimate"]) == pytest.approx(1 + 1 + 0.5 + 0.25)


def test_label_rank_is_the_labels_place_in_top_k_order():
    """Against lax.top_k on small integer logits (ties everywhere): rank < C exactly when
    the label is among the top-C, rank 0 exactly when it is the argmax."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.integers(-2, 3, size=(3, 5, 40)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 40, size=(3, 5)))
    rank = label_rank(logits, labels)
    order = np.argsort(-np.asarray(logits, np.float64), -1, kind="stable")
    want = np.argmax(order == np.asarray(labels)[..., None], -1)
    np.testing.assert_array_equal(rank, want)
    for c in (1, 4, 16):
        top = jax.lax.top_k(logits, c)[1]
        np.testing.assert_array_equal(rank < c, np.any(top == labels[..., None], -1))
    np.testing.assert_array_equal(rank == 0, jnp.argmax(logits, -1) == labels)


def reference_codes(drafter, e_out, tokens):
    """Float64 codes of `tokens`: unit((unit(E_out row) - mean) @ whiten)."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    e = f(e_out)[tokens]
    z = (e / np.linalg.norm(e, axis=-1, keepdims=True) - f(drafter.transfer_mean[...])) \
        @ f(drafter.transfer_whiten[...])
    return z / np.linalg.norm(z, axis=-1, keepdims=True)


def reference_transition_scores(drafter, pre, pred_tokens, rows, e_out):
    """Float64 numpy: redo the last layer's write with p = sqrt(r) c_a, final norm, dot."""
    inj = drafter.injection
    last = drafter.config.num_hidden_layers - 1
    r = drafter.config.dspine.transfer_rank
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    h = f(pre)
    z = h @ f(inj.readouts[last].weight[...]).T
    phi = math.sqrt(r) * z / np.linalg.norm(z, axis=-1, keepdims=True)
    p = math.sqrt(r) * reference_codes(drafter, e_out, pred_tokens)      # [..., P, r]
    gate = 1 / (1 + np.exp(-(phi[..., None, :] @ f(inj.receiver_gate.weight[...]).T
                             + p @ f(inj.predecessor_gate.weight[...]).T + f(inj.bias[...]))))
    msg = p @ f(inj.message.weight[...]).T
    rms = np.sqrt(np.mean(h * h, -1, keepdims=True))[..., None, :]
    refined = h[..., None, :] + rms * ((gate * msg) @ f(inj.writes[last].weight[...]).T)
    refined = rms_norm64(refined, f(drafter.norm.weight[...]), drafter.config.rms_norm_eps)
    return np.einsum("...PD,...CD->...PC", refined, f(rows))


def test_transition_scores_match_reference(target):
    drafter = make(target, "dspine")
    drafter.injection.predecessor_gate.weight[...] = jax.random.normal(
        jax.random.key(3), drafter.injection.predecessor_gate.weight.shape) * 0.1
    rng = np.random.default_rng(1)
    pre = rng.normal(size=(2, 3, 64)).astype(np.float32)
    preds = rng.integers(0, 97, size=(2, 3, 5))
    cands = rng.integers(0, 97, size=(2, 3, 4))
    rows = np.asarray(target.output_embedding())[cands]
    got = drafter.transition_scores(jnp.asarray(pre), jnp.asarray(preds), jnp.asarray(rows),
                                    target.output_embedding())
    ref = reference_transition_scores(drafter, pre, preds, rows, target.output_embedding())
    assert got.shape == (2, 3, 5, 4)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5)
    # Different predecessors give different scores: the head is predecessor-conditioned.
    assert not np.allclose(got[..., 0, :], got[..., 1, :])


def dspine_batch(target, drafter, response_from=(3, 3)):
    """response_from: each row's first response position."""
    feats = features(target, drafter, TOKENS)
    loss_mask = jnp.arange(TOKENS.shape[1])[None, :] >= jnp.asarray(response_from)[:, None]
    anchors, valid = ANCHORS, jnp.ones(ANCHORS.shape, bool)
    labels, sup = block_labels(TOKENS, loss_mask, anchors, valid, K)
    tgt = target(TOKENS)
    tlogits = target_slot_logits(tgt.final_hidden, anchors, K, target.output_embedding())
    positions = anchors[..., None] + jnp.arange(K)
    teacher = jnp.take_along_axis(TOKENS, jnp.clip(positions - 1, 0, 23).reshape(2, -1),
                                  1).reshape(positions.shape)
    return feats, anchors, labels, sup, tlogits, teacher


def test_refinement_and_alignment_terms_match_reference(target):
    drafter = make(target, "dspine")
    feats, anchors, labels, sup, tlogits, teacher = dspine_batch(target, drafter)
    out = drafter.forward_train(TOKENS, feats, anchors, target.input_embedding(),
                                target.output_embedding())
    config = LossConfig(gamma=7.0, backbone="ce+l1", ce_weight=0.1, refinement=True, top_k=4,
                        alignment=True, alignment_weight=0.5, alignment_warmup_steps=10,
                        logits="dense")
    loss, m = drafter_loss(config, drafter, out, labels, sup, target_logits=tlogits,
                           teacher_tokens=teacher, output_embedding=target.output_embedding(),
                           step=5)
    # Reference for the refinement term, slot by slot.
    logits, lab, sp = map(np.asarray, (out.logits, labels, sup))
    cands = np.argsort(-logits, -1)[..., :4]
    rows = np.asarray(target.output_embedding())[cands]
    scores = reference_transition_scores(drafter, np.asarray(out.pre_injection),
                                         np.asarray(teacher)[..., None], rows,
                                         target.output_embedding())[..., 0, :]
    q = softmax64(scores)
    p = softmax64(tlogits)
    p_c = np.take_along_axis(p, cands, -1)
    hit = cands == lab[..., None]
    ce_ref = np.where(hit.any(-1), -np.log((q * hit).sum(-1) + (~hit.any(-1))), 0)
    l1 = np.abs(q - p_c / p_c.sum(-1, keepdims=True)).sum(-1)
    l1 = np.where(p_c.sum(-1) >= 1e-4, l1, 0)
    ref = 0.1 * ce_ref + 0.9 * l1
    w = np.where(np.arange(K) >= 1, np.exp(-(np.arange(K) - 1) / 7.0), 0) * sp
    assert float(m["refinement"]) == pytest.approx((ref * w).sum() / w.sum(), rel=1e-3)
    # Alignment: sum over layers of 1 - cos(phi_l, c_label).
    codes = reference_codes(drafter, target.output_embedding(), lab)
    f = np.asarray(out.features, np.float64)
    cos = (f * codes).sum(-1) / np.linalg.norm(f, axis=-1)
    mis = (1 - cos).sum(0)
    assert float(m["alignment"]) == pytest.approx((mis * w).sum() / w.sum(), rel=1e-4)
    assert float(m["coverage"]) == pytest.approx((hit.any(-1) * sp).sum() / sp.sum())


def test_kernel_candidates_are_the_logits_top_k(target, monkeypatch):
    """loss.candidates = "kernel": vocab_top_k of the final hidden states gives the ids
    lax.top_k gives on the logits the loss holds (the xla path here; then the GPU kernel
    in interpret mode), so the whole DSpine loss is unchanged."""
    drafter = make(target, "dspine")
    feats, anchors, labels, sup, tlogits, teacher = dspine_batch(target, drafter)
    e_out = target.output_embedding()
    out = drafter.forward_train(TOKENS, feats, anchors, target.input_embedding(), e_out)
    want = np.asarray(jax.lax.top_k(out.logits, 6)[1])
    got = refinement_candidates("kernel", out.logits, out.hidden, e_out, 6)
    np.testing.assert_array_equal(got, want)

    import importlib

    proposal = importlib.import_module("pallas_kernels.dspine_proposal")
    vocab_top_k = proposal.vocab_top_k
    interpreted = lambda h, w, k: vocab_top_k(  # noqa: E731
        h, w, k, implementation="pallas_gpu", interpret=True)
    monkeypatch.setattr(proposal, "vocab_top_k", interpreted)
    got = refinement_candidates("kernel", out.logits, out.hidden, e_out, 6)
    np.testing.assert_array_equal(got, want)
    monkeypatch.undo()

    def loss(source):
        config = LossConfig(gamma=7.0, backbone="ce+l1", refinement=True, top_k=4,
                            candidates=source, logits="dense")
        return drafter_loss(config, drafter, out, labels, sup, target_logits=tlogits,
                            teacher_tokens=teacher, output_embedding=e_out, step=5)

    (a, ma), (b, mb), (c, mc) = loss("logits"), loss("kernel"), loss("auto")
    assert float(a) == float(b) and float(ma["refinement"]) == float(mb["refinement"])
    assert float(c) == float(a) and float(mc["refinement"]) == float(ma["refinement"])
    with pytest.raises(ConfigError, match="loss.candidates"):
        LossConfig(candidates="sorted")


def test_gradients_reach_only_trainable_parameters(target):
    drafter = make(target, "dspine")
    feats, anchors, labels, sup, tlogits, teacher = dspine_batch(target, drafter)
    config = LossConfig(top_k=4, alignment_warmup_steps=1).resolve(drafter.config)
    e_in, e_out = target.input_embedding(), target.output_embedding()

    def loss_fn(model, e_in, e_out):
        out = model.forward_train(TOKENS, feats, anchors, e_in, e_out)
        return drafter_loss(config, model, out, labels, sup, target_logits=tlogits,
                            teacher_tokens=teacher, output_embedding=e_out, step=10)[0]

    # jitted: eager dispatch of every op of the loss and its gradient is far slower
    grads = nnx.jit(nnx.grad(loss_fn, argnums=nnx.DiffState(0, nnx.Param)))(drafter, e_in, e_out)
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(grads)}
    assert not any(n.startswith("transfer_") for n in names)  # the basis is not trainable
    flat = {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(grads)}
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight",
                 "injection.writes.0.weight", "injection.readouts.0.weight", "norm.weight"):
        assert np.abs(flat[name]).sum() > 0, name

    basis_before = np.asarray(drafter.transfer_whiten[...]), np.asarray(drafter.transfer_mean[...])
    optimizer = nnx.Optimizer(drafter, optax.adamw(1e-2), wrt=nnx.Param)
    optimizer.update(drafter, grads)
    np.testing.assert_array_equal(drafter.transfer_whiten[...], basis_before[0])
    np.testing.assert_array_equal(drafter.transfer_mean[...], basis_before[1])
    # The target's tables are arguments, not drafter state: they cannot be updated.
    state_names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(drafter))}
    assert not any("embed" in n or "lm_head" in n for n in state_names)


@pytest.mark.parametrize("kind,backbone", [("dflash", "ce+l1"), ("dspine", "ce")])
def test_either_loss_with_either_drafter(target, kind, backbone):
    drafter = make(target, kind)
    feats, anchors, labels, sup, tlogits, teacher = dspine_batch(target, drafter)
    config = LossConfig(backbone=backbone, top_k=4).resolve(drafter.config)
    out = drafter.forward_train(TOKENS, feats, anchors, target.input_embedding(),
                                target.output_embedding())
    loss, m = drafter_loss(config, drafter, out, labels, sup, target_logits=tlogits,
                           teacher_tokens=teacher, output_embedding=target.output_embedding())
    assert np.isfinite(float(loss)) and ("backbone_l1" in m) == (backbone == "ce+l1")


def test_per_device_loss_shares_add_up_to_the_whole_batch(target):
    """Data parallelism as the trainer runs it (each device its rows, all_sum = psum):
    the shares sum to the whole batch's loss, their gradients to its gradient, and every
    metric is the whole batch's. Rows get unequal supervised counts, so a per-device mean
    (or a mean of means) would not match."""
    drafter = make(target, "dspine")
    e_in, e_out = target.input_embedding(), target.output_embedding()
    feats, anchors, labels, sup, tlogits, teacher = dspine_batch(target, drafter, (3, 14))
    config = LossConfig(top_k=4, alignment_warmup_steps=1).resolve(drafter.config)
    graph, params, rest = nnx.split(drafter, nnx.Param, ...)
    batch = (TOKENS, feats, anchors, labels, sup, tlogits, teacher)

    def loss(params, tokens, feats, anchors, labels, sup, tlogits, teacher, all_sum=None):
        model = nnx.merge(graph, params, rest)
        out = model.forward_train(tokens, feats, anchors, e_in, e_out)
        return drafter_loss(config, model, out, labels, sup, target_logits=tlogits,
                            teacher_tokens=teacher, output_embedding=e_out, step=3,
                            all_sum=all_sum)

    (whole, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, *batch)

    def device(rows):  # one "device": one row, [1, ...]
        psum = lambda x: jax.lax.psum(x, "devices")  # noqa: E731
        return jax.value_and_grad(loss, has_aux=True)(params, *rows, all_sum=psum)

    (shares, dev_metrics), dev_grads = jax.jit(jax.vmap(device, axis_name="devices"))(
        tuple(x[:, None] for x in batch))
    assert float(sup[0].sum()) != float(sup[1].sum())
    np.testing.assert_allclose(shares.sum(), whole, rtol=1e-5)
    assert not np.allclose(shares[0], whole / 2, rtol=1e-2)  # the shares are weighted
    for name, value in metrics.items():
        for d in range(2):
            np.testing.assert_allclose(dev_metrics[name][d], value, rtol=1e-5, atol=1e-6,
                                       err_msg=name)
    for (path, g), dg in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                             jax.tree.leaves(dev_grads)):
        np.testing.assert_allclose(np.asarray(dg).sum(0), g, rtol=1e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_fused_logits_give_the_dense_loss_metrics_and_gradients(target, kind):
    """loss.logits = "fused" (lm_head_stats from the hidden states; the target's lse from
    its slot hidden states) against "dense" ([B, n, K, V] logits and autodiff) on the same
    batch: the loss, every metric and the gradient of every parameter agree."""
    drafter = make(target, kind)
    feats, anchors, labels, sup, tlogits, teacher = dspine_batch(target, drafter, (3, 9))
    thidden = target_slot_hidden(target(TOKENS).final_hidden, anchors, K)
    e_in, e_out = target.input_embedding(), target.output_embedding()
    graph, params, rest = nnx.split(drafter, nnx.Param, ...)

    def run(logits):
        config = LossConfig(backbone="ce", top_k=4, alignment_warmup_steps=1, logits=logits,
                            candidates="logits" if logits == "dense" else "auto"
                            ).resolve(drafter.config)
        assert config.fused_logits == (logits == "fused")

        def loss(params):
            model = nnx.merge(graph, params, rest)
            out = model.forward_train(TOKENS, feats, anchors, e_in, e_out,
                                      logits=logits == "dense")
            return drafter_loss(config, model, out, labels, sup,
                                target_logits=tlogits if logits == "dense" else None,
                                target_hidden=thidden if logits == "fused" else None,
                                teacher_tokens=teacher, output_embedding=e_out, step=3)

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (loss_d, m_d), g_d = run("dense")
    (loss_f, m_f), g_f = run("fused")
    assert float(loss_f) == pytest.approx(float(loss_d), rel=1e-5)
    assert set(m_f) == set(m_d)
    for name in m_d:
        np.testing.assert_allclose(m_f[name], m_d[name], rtol=1e-5, atol=1e-6, err_msg=name)
    for (path, a), (_, b) in zip(nnx.to_flat_state(g_d), nnx.to_flat_state(g_f)):
        np.testing.assert_allclose(b[...], a[...], rtol=2e-4, atol=1e-6,
                                   err_msg=".".join(map(str, path)))


def test_fused_logits_refuse_what_they_cannot_compute():
    with pytest.raises(ConfigError, match="candidates"):
        LossConfig(logits="fused", candidates="logits")
    with pytest.raises(ConfigError, match="ce\\+l1"):
        LossConfig(logits="fused", backbone="ce+l1")
    with pytest.raises(ConfigError, match="default backbone"):
        LossConfig(logits="fused").resolve(make_config("dspine"))
    with pytest.raises(ConfigError, match="loss.logits"):
        LossConfig(logits="sparse")
    assert LossConfig(backbone="ce", logits="fused").resolve(make_config("dspine")).fused_logits
    with pytest.raises(ValueError, match="resolve"):
        LossConfig().fused_logits


def test_auto_logits_are_fused_only_where_timed_faster_and_allowed():
    """loss.logits = "auto": fused on a GPU for a CE backbone whose candidates come from
    the kernel and a drafter at most FUSED_MAX_HIDDEN wide; dense otherwise."""
    from dspine_jax.losses import FUSED_MAX_HIDDEN, auto_logits

    assert auto_logits("ce", "auto", 576, backend="gpu") == "fused"
    assert auto_logits("ce", "kernel", FUSED_MAX_HIDDEN, backend="gpu") == "fused"
    assert auto_logits("ce", "auto", FUSED_MAX_HIDDEN + 1, backend="gpu") == "dense"
    assert auto_logits("ce+l1", "auto", 576, backend="gpu") == "dense"
    assert auto_logits("ce", "logits", 576, backend="gpu") == "dense"
    for backend in ("cpu", "tpu"):
        assert auto_logits("ce", "auto", 576, backend=backend) == "dense"
    # resolve decides it; on this (CPU) backend, dense
    assert LossConfig(backbone="ce").resolve(make_config("dflash")).logits == "dense"
    assert LossConfig().resolve(make_config("dspine")).logits == "dense"
    assert LossConfig(logits="dense").resolve(make_config("dflash")).logits == "dense"


def test_slot_metrics_do_not_depend_on_the_alignment_term(target):
    """Per-slot accuracy is the drafter's argmax against the label whatever loss terms
    run (the alignment term once shadowed the label ranks and zeroed it)."""
    drafter = make(target, "dspine")
    feats, anchors, labels, sup, tlogits, teacher = dspine_batch(target, drafter)
    out = drafter.forward_train(TOKENS, feats, anchors, target.input_embedding(),
                                target.output_embedding())
    metrics = {}
    for alignment in (False, True):
        config = LossConfig(backbone="ce", top_k=4, alignment=alignment,
                            alignment_warmup_steps=1).resolve(drafter.config)
        metrics[alignment] = drafter_loss(config, drafter, out, labels, sup,
                                          target_logits=tlogits, teacher_tokens=teacher,
                                          output_embedding=target.output_embedding(),
                                          step=3)[1]
    correct = (np.argmax(np.asarray(out.logits), -1) == np.asarray(labels)) & np.asarray(sup)
    want = correct.sum((0, 1)) / np.maximum(np.asarray(sup).sum((0, 1)), 1)
    for alignment in (False, True):
        np.testing.assert_allclose(metrics[alignment]["slot_accuracy"][1:], want[1:],
                                   rtol=1e-6)
    assert want[1:].max() > 0
