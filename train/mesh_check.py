"""Does a training config's mesh compute what one device computes? One batch, one step.

  python -m dspine_train.mesh_check --config train/configs/smollm2_dspine.toml [--set k=v ...]

Runs, for the same batch, on the first device alone and on the config's `data x fsdp`
mesh over all devices: (1) the target's forward pass (the features the drafter reads, the
final hidden state), (2) one training step (every loss metric, the gradient norm, the
updated parameters); on the mesh twice, without and with the buffer donation that
`dspine train` uses. Prints the relative gap of each and exits 1 when any is non-finite or
above --tolerance; the first row that fails is where the mesh goes wrong. Run it before a
long multi-device job; a few seconds after compilation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspine_jax.checkpoints import load_target, resolve_dtype
from dspine_train import sharding
from dspine_train.config import load_config
from dspine_train.data import BatchStream
from dspine_train.drafter_setup import build_drafter, resolved_loss, split_drafter
from dspine_train.optimizer import make_optimizer
from dspine_train.step import make_step


def relative_gap(reference, other) -> float:
    """||other - reference|| / ||reference|| (Frobenius); inf when `other` has a non-finite
    value that `reference` does not. A norm, not a max: in bf16 a single activation among
    SmolLM2's outliers (|x| up to 2.5e4) legitimately moves by more than its neighbours'
    scale when the per-device batch, and so the matmul blocking, changes."""
    ref, got = np.asarray(reference, np.float64), np.asarray(other, np.float64)
    if not np.all(np.isfinite(got) | ~np.isfinite(ref)):
        return float("inf")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-12))


def real_positions(loss_mask: np.ndarray) -> np.ndarray:
    """[B, T] True up to each row's last supervised token: padding after it never reaches
    the loss, and its activations are not worth comparing."""
    last = np.where(loss_mask.any(1), loss_mask.shape[1] - 1 - np.argmax(loss_mask[:, ::-1], 1),
                    -1)
    return np.arange(loss_mask.shape[1])[None, :] <= last[:, None]


def run_on(mesh, cfg, parts, batch_rows, donate: bool = False):
    """Place everything on `mesh` and run the target forward and one step there
    (`donate`: parameters and optimizer state donated to the step, as `dspine train` does)."""
    target_graph, target_params, drafter_graph, params, rest, tx, loss_config, dc = parts
    place = lambda tree: sharding.shard_tree(tree, mesh)  # noqa: E731
    tokens, mask = (sharding.global_batch(a, mesh) for a in batch_rows)
    target_params, rest, params = place(target_params), place(rest), place(params)
    opt_state = place(tx.init(params))
    ids = dc.target_layer_ids

    @jax.jit
    def forward(target_params, tokens):
        out = nnx.merge(target_graph, target_params)(tokens, hidden_layer_ids=ids,
                                                      return_logits=False)
        return out.features(), out.final_hidden

    features, final_hidden = jax.device_get(forward(target_params, tokens))
    real = real_positions(batch_rows[1])
    features, final_hidden = features[real], final_hidden[real]
    step = jax.jit(make_step(cfg, target_graph, drafter_graph, tx, loss_config, dc,
                             resolve_dtype(cfg.run.compute_dtype), mesh),
                   donate_argnums=(2, 3) if donate else ())
    rng = jax.random.key(cfg.run.seed)
    new_params, _, _, _, metrics = step(target_params, rest, params, opt_state,
                                        jnp.asarray(0, jnp.int32), rng, tokens, mask)
    return {"features": features, "final_hidden": final_hidden,
            **{f"metric {k}": v for k, v in jax.device_get(metrics).items()},
            **{f"param {jax.tree_util.keystr(path)}": leaf for path, leaf in
               jax.tree_util.tree_flatten_with_path(jax.device_get(new_params))[0]}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--set", action="append", default=[], help="section.key=value")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="Largest relative gap accepted (bf16 compute: a few 1e-3 is usual).")
    p.add_argument("--donation", choices=("both", "off", "on"), default="both",
                   help="Run the mesh step without buffer donation, with it, or both.")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
    one = sharding.make_mesh(1, 1, jax.devices()[:1])

    loaded = load_target(cfg.target.name, dtype=cfg.target.dtype)
    drafter = build_drafter(cfg, loaded)
    target_graph, target_params = nnx.split(loaded.model)
    drafter_graph, params, rest = split_drafter(drafter)
    tx, _ = make_optimizer(cfg)
    losses = resolved_loss(cfg, drafter.config)
    parts = (target_graph, target_params, drafter_graph, params, rest, tx, losses,
             drafter.config)
    tokens, mask, _ = BatchStream(Path(cfg.data.path), cfg.data.seq_len, cfg.run.batch_size,
                                  cfg.run.seed).next()

    print(f"mesh {dict(mesh.shape)} on {mesh.devices.size} {jax.devices()[0].platform} "
          f"devices vs one device; batch {tokens.shape}")
    reference = run_on(one, cfg, parts, (tokens, mask))
    failed = []
    runs = {"both": (False, True), "off": (False,), "on": (True,)}[args.donation]
    for donate in runs:  # donation last: it may consume the placed buffers
        label = "donated" if donate else "no donation"
        print(f"-- mesh, {'donated parameters and optimizer state' if donate else label}")
        candidate = run_on(mesh, cfg, parts, (tokens, mask), donate=donate)
        params = params_ok = 0
        for name, value in reference.items():
            gap = relative_gap(value, candidate[name])
            bad = not gap <= args.tolerance
            failed += [f"{name} ({label})"] if bad else []
            if name.startswith("param "):
                params, params_ok = params + 1, params_ok + (not bad)
            if bad or not name.startswith("param "):
                print(f"{'FAIL' if bad else 'ok  '} {name:40s} relative gap {gap:.2e}")
        print(f"{params_ok} of {params} updated parameter tensors within {args.tolerance:g}")
    if failed:
        print(f"MISMATCH: {len(failed)} values; first: {failed[0]}")
        return 1
    print("the mesh matches one device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
