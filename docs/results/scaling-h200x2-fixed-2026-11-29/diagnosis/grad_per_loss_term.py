"""Where does the 2-GPU data-parallel backward produce NaN? Per-loss-term gradients on the
mesh vs one device, then checkify float checks on the mesh's full gradient.
Run from the repo root on the two-GPU machine, before the trainer's fix:
python3 grad_per_loss_term.py data.path=DATA  (output: grad-per-loss-term.log; the
checkify pass did not finish within the call's limit).
"""
import sys, time
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.experimental import checkify
from dspine_jax.checkpoints import load_target, resolve_dtype
from dspine_jax.drafters.blocks import block_labels, predecessor_tokens, sample_anchors, target_slot_logits
from dspine_jax.losses import LossConfig, drafter_loss
from train import sharding
from train.config import load_config
from train.trainer import BatchStream, build_drafter, split_drafter

cfg = load_config(Path("train/configs/smollm2_dspine.toml"), sys.argv[1:])
loaded = load_target(cfg.target.name, dtype=cfg.target.dtype)
drafter = build_drafter(cfg, loaded)
tg, tp = nnx.split(loaded.model)
dg, params, rest = split_drafter(drafter)
dc = drafter.config
lc = LossConfig.for_drafter(dc, backbone=cfg.loss.backbone or None)
cdt = resolve_dtype(cfg.run.compute_dtype)
tokens_np, mask_np, _ = BatchStream(Path(cfg.data.path), cfg.data.seq_len, cfg.run.batch_size, cfg.run.seed).next()
k, n, ids = dc.block_size, cfg.data.blocks_per_seq, dc.target_layer_ids

def metrics_of(tp, rest, params, rng, tokens, loss_mask):
    target = nnx.merge(tg, tp)
    rng, ak, rk = jax.random.split(rng, 3)
    out = target(tokens, hidden_layer_ids=ids, return_logits=False)
    feats, fh = jax.lax.stop_gradient(out.features()), jax.lax.stop_gradient(out.final_hidden)
    e_in, e_out = target.input_embedding(), target.output_embedding()
    anchors, valid = sample_anchors(ak, loss_mask, n)
    labels, sup = block_labels(tokens, loss_mask, anchors, valid, k)
    tl = target_slot_logits(fh.astype(e_out.dtype), anchors, k, e_out)
    teacher = predecessor_tokens(tokens, anchors, k)
    replace = jax.random.bernoulli(rk, 0.5, anchors.shape)
    d = nnx.merge(dg, jax.tree.map(lambda x: x.astype(cdt), params), rest)
    draft = d.forward_train(tokens, feats, anchors, e_in, e_out, replace=replace)
    loss, m = drafter_loss(lc, d, draft, labels, sup, target_logits=tl, teacher_tokens=teacher,
                           output_embedding=e_out, step=0)
    m["loss"] = loss
    return m

def gnorms(term, mesh):
    place = lambda t: sharding.shard_tree(t, mesh)
    tok, msk = (sharding.global_batch(a, mesh) for a in (tokens_np, mask_np))
    g = jax.jit(jax.grad(lambda p, *a: metrics_of(a[0], a[1], p, *a[2:])[term]))(
        place(params), place(tp), place(rest), jax.random.key(0), tok, msk)
    return {jax.tree_util.keystr(p): float(np.linalg.norm(np.asarray(x, np.float64)))
            for p, x in jax.tree_util.tree_flatten_with_path(jax.device_get(g))[0]}

mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
one = sharding.make_mesh(1, 1, jax.devices()[:1])
terms = [t for t in ("backbone_ce", "backbone_l1", "refinement", "alignment") if t in
         jax.eval_shape(metrics_of, tp, rest, params, jax.random.key(0), tokens_np, mask_np)]
for term in terms + ["loss"]:
    t0 = time.time()
    a, b = gnorms(term, one), gnorms(term, mesh)
    bad = [name for name in a if not np.isfinite(b[name]) or abs(b[name] - a[name]) > 0.05 * max(a[name], 1e-6)]
    print(f"TERM {term}: {len(bad)} of {len(a)} grads off ({time.time()-t0:.0f} s)", flush=True)
    for name in bad[:12]:
        print(f"   {name}: one {a[name]:.4g} mesh {b[name]:.4g}", flush=True)

# checkify: the first NaN-producing primitive in the mesh's gradient
place = lambda t: sharding.shard_tree(t, mesh)
tok, msk = (sharding.global_batch(a, mesh) for a in (tokens_np, mask_np))
f = checkify.checkify(jax.grad(lambda p, *a: metrics_of(a[0], a[1], p, *a[2:])["loss"]),
                      errors=checkify.float_checks)
err, _ = jax.jit(f)(place(params), place(tp), place(rest), jax.random.key(0), tok, msk)
print("CHECKIFY:", err.get(), flush=True)
