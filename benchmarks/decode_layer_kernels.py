"""The fused decode-layer kernels (`pallas_kernels.decode_layer`) against XLA's fusions of
the same layer, per tile choice, at a preset's shapes: what to tune them from.

    python -m dspine_benchmarks.decode_layer_kernels --target preset:smollm2-135m --rows 1 8 16 \\
        --tiles 64,32,4,3 128,32,4,3 256,16,4,4 --out layer_kernels.jsonl

One program runs `--layers` layers (random weights, each its own arrays, unrolled: no
weight is sliced out of a stack) of a decode layer without its attention: q, k, v from the
normed input with RoPE, the output projection of q with the residual, the normed gate/up
with SiLU, the down projection with the residual. `xla` is the plain-JAX reference that
XLA fuses as it fuses the target's layers; each `--tiles BD,BN,WARPS,STAGES` runs the
Pallas kernels with input chunk BD, BN output columns per program (the MLP's and the
projections'), WARPS warps and STAGES loads in flight. Each figure is the median of
`--repeats` timings of the whole program, divided by the layers; `floor_us` is a layer's
weights over the copy bandwidth measured in the same process, and `max_abs_diff` how far
the last layer's output is from XLA's. GPU only (the kernels' compiled form); on a CPU
`--interpret` checks the script.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from datetime import date

import jax
import jax.numpy as jnp
import numpy as np


def layer_weights(config, key, dtype):
    """One layer's weights ([out, in]) at `config`'s shapes, and its norms."""
    d, h = config.hidden_size, config.head_dim
    n, k, f = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    shapes = {"wq": (n * h, d), "wk": (k * h, d), "wv": (k * h, d), "wo": (d, n * h),
              "wg": (f, d), "wu": (f, d), "wd": (d, f)}
    keys = jax.random.split(key, len(shapes) + 2)
    w = {name: (jax.random.normal(kk, shape, jnp.float32) * 0.02).astype(dtype)
         for kk, (name, shape) in zip(keys, shapes.items())}
    w["norm1"] = jnp.ones((d,), dtype)
    w["norm2"] = jnp.ones((d,), dtype)
    if config.qk_norm:
        w["q_norm"], w["k_norm"] = jnp.ones((h,), dtype), jnp.ones((h,), dtype)
    return w


def layer_stack(ops, layers, x, cos, sin, eps):
    """x [R, D] through every layer; k and v feed a running sum so that nothing is dead."""
    qkv, swiglu, residual = ops
    touched = jnp.zeros((), jnp.float32)
    for w in layers:
        norms = (w["q_norm"], w["k_norm"]) if "q_norm" in w else ()
        q, k, v = qkv(x, w["norm1"], w["wq"], w["wk"], w["wv"], cos, sin, *norms, eps=eps)
        touched += k[0, 0].astype(jnp.float32) + v[0, 0].astype(jnp.float32)
        x = residual(q, w["wo"], x)
        x = residual(swiglu(x, w["norm2"], w["wg"], w["wu"], eps=eps), w["wd"], x)
    return x, touched


def reference_ops():
    from pallas_kernels.decode_layer import reference as ref

    def qkv(x, norm, wq, wk, wv, cos, sin, q_norm=None, k_norm=None, *, eps):
        return ref.norm_qkv_rope_reference(x, norm, wq, wk, wv, cos, sin, eps=eps,
                                           q_norm=q_norm, k_norm=k_norm)

    return qkv, ref.norm_swiglu_reference, ref.matmul_residual_reference


def kernel_ops(tiles, interpret: bool):
    from pallas_kernels.decode_layer import gpu

    bd, bn, warps, stages = tiles
    common = {"interpret": interpret, "block_d": bd, "num_warps": warps, "num_stages": stages}

    def qkv(x, norm, wq, wk, wv, cos, sin, q_norm=None, k_norm=None, *, eps):
        return gpu.norm_qkv_rope_gpu(x, norm, wq, wk, wv, cos, sin, eps=eps, q_norm=q_norm,
                                     k_norm=k_norm, **common)

    return (qkv, functools.partial(gpu.norm_swiglu_gpu, block_n=bn, **common),
            functools.partial(gpu.matmul_residual_gpu, block_n=bn, **common))


def parse_tiles(text: str) -> tuple[int, int, int, int]:
    try:
        bd, bn, warps, stages = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tiles takes BD,BN,WARPS,STAGES, got {text!r}")
    return bd, bn, warps, stages


def median_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> list[dict]:
    from dspine_benchmarks.abstract_models import target_config
    from dspine_benchmarks.decode_step import jax_copy_bandwidth

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="preset:smollm2-135m")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--layers", type=int, default=None, help="default: the target's")
    p.add_argument("--tiles", type=parse_tiles, nargs="+", default=[(64, 32, 4, 3)],
                   metavar="BD,BN,WARPS,STAGES")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    p.add_argument("--out", default=None, help="append one JSON line per row")
    args = p.parse_args(argv)

    config = target_config(args.target, None)
    depth = args.layers or config.num_hidden_layers
    dtype = jnp.dtype(args.dtype)
    layers = [layer_weights(config, jax.random.key(i), dtype) for i in range(depth)]
    weight_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(layers[0]))
    bandwidth = jax_copy_bandwidth()
    variants = [("xla", reference_ops())] + [
        (",".join(map(str, t)), kernel_ops(t, args.interpret)) for t in args.tiles]
    rows_out = []
    for r in args.rows:
        x = jax.random.normal(jax.random.key(99), (r, config.hidden_size)).astype(dtype)
        angles = jnp.arange(r, dtype=jnp.float32)[:, None] * jnp.linspace(
            0.01, 1, config.head_dim // 2)[None, :]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        base = expected = None
        for name, ops in variants:
            program = jax.jit(functools.partial(layer_stack, ops, eps=1e-6))
            out = np.asarray(program(layers, x, cos, sin)[0], np.float32)
            seconds = median_seconds(lambda: program(layers, x, cos, sin), args.repeats)
            us = seconds / depth * 1e6
            if name == "xla":
                base, expected = us, out
            row = {"target": args.target, "rows": r, "tiles": name, "layers": depth,
                   "us_per_layer": us, "x_xla": us / base,
                   # the last layer's output against XLA's (bf16 roundings may differ)
                   "max_abs_diff": float(np.max(np.abs(out - expected))),
                   "floor_us": weight_bytes / bandwidth * 1e6, "dtype": args.dtype,
                   "device": str(jax.devices()[0]), "jax": jax.__version__,
                   "date": str(date.today())}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(f"\n{'rows':>4} {'tiles (BD,BN,W,S)':>18} {'us/layer':>9} {'x xla':>6} {'floor':>6}")
    for row in rows_out:
        print(f"{row['rows']:4d} {row['tiles']:>18} {row['us_per_layer']:9.2f} "
              f"{row['x_xla']:6.2f} {row['floor_us']:6.2f}")
    return rows_out


if __name__ == "__main__":
    main()
