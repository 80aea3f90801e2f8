"""Time the training loss's vocabulary statistics (`pallas_kernels.lm_head_stats`) against
the dense logits they replace, forward and forward + backward, on training shapes.

    python -m dspine_benchmarks.loss_kernels --out loss_kernels.jsonl    # CUDA or TPU
    python -m dspine_benchmarks.loss_kernels                             # CPU: tiny shape

For hidden [R, D] (bf16) against an lm_head [V, D] and labels [R], each row times
`lse - label_logit` summed (the CE) and, with --backward, its value and gradient in the
hidden states:
  dense        the reference: the [R, V] float32 logits, logsumexp, take; plain autodiff
  xla:N        lm_head_stats(implementation="xla", chunk=N): vocabulary chunks of N under
               lax.scan (forward and the custom-VJP backward)
  pallas_gpu / pallas_tpu   the forward kernel, then the same chunked backward
Shapes: the SmolLM2 drafters' training step (R = 32 x 32 blocks x 16 slots = 16,384 rows,
D 576, V 49,152) and a Qwen3-8B-sized one (R 4,096, D 4,096, V 151,936); on a CPU a tiny
shape (R 256, D 64, V 4,096), with the Pallas forward in interpret mode.

The floor is arithmetic: each product of the logits is 2 R V D FLOPs (the forward one;
the backward recomputes it and adds the gradient's, so a fused forward + backward runs
three where the dense one runs two); `tflops` counts the dense path's products (the
useful work, as MFU does) over the time, and `bytes_logits` is what one [R, V] float32
tensor of logits would take. Timing as `jax_kernels`: a warm-up, then n back-to-back
calls and one block_until_ready, the median over repeats.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dspine_benchmarks.jax_kernels import jaxlib_version, timed
from pallas_kernels.lm_head_stats import lm_head_stats, lm_head_stats_reference

SHAPES = {"smollm2_train": (16384, 576, 49152), "qwen3_8b_train": (4096, 4096, 151936),
          "tiny": (256, 64, 4096)}


def objective(stats):
    def ce(hidden, weight, labels):
        lse, value, _ = stats(hidden, weight, labels)
        return jnp.sum(lse - value)
    return ce


def variants(platform: str, chunks: list[int]):
    """(name, stats function) per implementation timed on this platform."""
    out = [("dense", lm_head_stats_reference)]
    for c in chunks:
        out.append((f"xla:{c}", lambda h, w, y, c=c: lm_head_stats(
            h, w, y, implementation="xla", chunk=c)))
    kernel = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform, "pallas_gpu")
    out.append((kernel, lambda h, w, y: lm_head_stats(
        h, w, y, implementation=kernel, interpret=platform == "cpu")))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--chunks", default="4096,8192,16384",
                    help="comma list of the xla path's chunk sizes")
    ap.add_argument("--no-backward", action="store_true", help="time the forward only")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="append one JSON line per row")
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)
    platform = jax.default_backend()
    cpu = platform == "cpu"
    shapes = (args.shapes.split(",") if args.shapes
              else ["tiny"] if cpu else ["smollm2_train", "qwen3_8b_train"])
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        sys.exit(f"unknown shapes {unknown}; choose from {sorted(SHAPES)}")
    iters = args.iters or (2 if cpu else 10)
    chunks = [int(c) for c in args.chunks.split(",") if c]
    meta = {"date": datetime.date.today().isoformat(), "platform": platform,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "jaxlib": jaxlib_version()}
    print(f"device {meta['device']}; jax {meta['jax']}")
    for shape in shapes:
        r, d, v = SHAPES[shape]
        rng = np.random.default_rng(0)
        hidden = jnp.asarray(rng.standard_normal((r, d)) / np.sqrt(d), jnp.bfloat16)
        weight = jnp.asarray(rng.standard_normal((v, d)), jnp.bfloat16)
        labels = jnp.asarray(rng.integers(0, v, r), jnp.int32)
        reference = None
        for name, stats in variants(platform, chunks):
            for backward in (False,) if args.no_backward else (False, True):
                fn = objective(stats)
                fn = jax.jit(jax.value_and_grad(fn) if backward else fn)
                try:
                    us = timed(fn, (hidden, weight, labels), iters, args.repeats)
                except Exception as e:          # noqa: BLE001 (a row that cannot run)
                    print(f"{shape:15s} {name:11s} {'fwd+bwd' if backward else 'fwd':8s} "
                          f"failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                value = fn(hidden, weight, labels)
                value = float(value[0] if backward else value)
                reference = value if name == "dense" and not backward else reference
                products = 2 if backward else 1
                row = dict(meta, shape=shape, rows=r, hidden=d, vocab=v, variant=name,
                           backward=backward, us=round(us, 1),
                           tflops=round(products * 2 * r * v * d / us / 1e6, 1),
                           bytes_logits=4 * r * v,
                           rel_diff=abs(value - reference) / abs(reference)
                           if reference else None)
                print(f"{shape:15s} {name:11s} {'fwd+bwd' if backward else 'fwd':8s} "
                      f"{us / 1e3:9.3f} ms  {row['tflops']:7.1f} TFLOP/s  "
                      f"ce rel diff {row['rel_diff']:.1e}")
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
