"""Time a target layer's projections at the row counts of an AR step and of a verify.

    python -m dspine_benchmarks.verify_gemms --target preset:qwen3-8b --out gemms.jsonl  # GPU
    python -m dspine_benchmarks.verify_gemms --target preset:smollm2-135m --rows 16 --layers 2 # CPU

A decoder's projections (q/k/v fused, o, gate/up fused, down, the lm_head) as the models
compute them (`x @ W.T`, W [out, in], bfloat16 in and out), at M rows: batch rows in an
AR step, batch x 16 in a verify. M is small beside the weights, so each product should
run at the weights' read: the table gives each product's microseconds, its weights' bytes
over that time (GB/s) and that against the copy bandwidth measured in the same run (a copy
reads and writes, a product mostly reads, so a product can pass 100%).

Each product runs `--layers` times in one compiled program over that many distinct
weights (more than the L2 cache holds, as a model's layers are), and the figure is the
median over `--repeats` of (program time / layers). Paths: `xla` (the models' einsum:
XLA chooses cuBLAS or its Triton GEMMs); `split-kS` (K split in S slices, one batched
product over the slices accumulated in float32 and summed: S times the tiles of a
short-M product, for products whose columns alone do not fill the GPU's
multiprocessors); `pallas`, `pallas_kernels.split_k_matmul` with its default tiling, and
with overrides appended: `-sS` S splits, `-nBN` and `-kBK` column and input tiles, `-wW`
warps, `-pP` pipeline stages (`pallas-s4-k128`; GPU only, `--interpret` runs it in
Pallas interpret mode; a tiling that does not fit the GPU is reported and skipped).
Every path is checked against the float32 product before timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json

import jax
import jax.numpy as jnp
from dspine_benchmarks.decode_step import jax_copy_bandwidth, median_time


def projections(config) -> list[tuple[str, int, int]]:
    """(name, out, in) of a layer's products and the lm_head, fused as the decoders run them."""
    d, f = config.hidden_size, config.intermediate_size
    head = config.head_dim
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head
    return [("qkv", qkv, d), ("o", d, config.num_attention_heads * head),
            ("gate_up", 2 * f, d), ("down", d, f), ("lm_head", config.vocab_size, d)]


def product(path: str, interpret: bool = False):
    """x [M, K], w [N, K] -> [M, N] in x's dtype."""
    if path == "xla":
        return lambda x, w: jnp.einsum("mk,nk->mn", x, w)
    if path.startswith("pallas"):
        from pallas_kernels.split_k_matmul import split_k_matmul

        def pallas(x, w):
            tiling = pallas_tiling(path, x.shape[0], w.shape[0], x.shape[1])
            return split_k_matmul(x, w, tiling, interpret=interpret)
        return pallas
    slices = int(path.removeprefix("split-k"))

    def split(x, w):
        m, k = x.shape
        parts = jnp.einsum("msk,nsk->smn", x.reshape(m, slices, k // slices),
                           w.reshape(w.shape[0], slices, k // slices),
                           preferred_element_type=jnp.float32)
        return parts.sum(0).astype(x.dtype)
    return split


OVERRIDES = {"s": "splits", "n": "block_n", "k": "block_k", "w": "num_warps",
             "p": "num_stages"}


def pallas_overrides(path: str) -> dict | None:
    """`pallas[-sS][-nBN][-kBK][-wW][-pP]` -> the Tiling fields it sets (None: not such a
    path)."""
    parts = path.split("-")
    if parts[0] != "pallas":
        return None
    fields = {}
    for part in parts[1:]:
        if part[:1] not in OVERRIDES or not part[1:].isdigit():
            return None
        fields[OVERRIDES[part[0]]] = int(part[1:])
    return fields


def pallas_tiling(path: str, m: int, n: int, k: int):
    from pallas_kernels.split_k_matmul import default_tiling

    return dataclasses.replace(default_tiling(m, n, k), **pallas_overrides(path))


def chained(fn):
    """One compiled program of fn over L distinct weights, one after another: each
    product's x is nudged by a sum over the last product's whole output, so that none is
    hoisted, skipped or cut down to the columns read. Distinct arrays, not slices of one
    stacked array in a scan, which XLA may copy before each product."""
    @jax.jit
    def run(x, weights):
        for w in weights:
            y = fn(x, w)
            x = x + jnp.sum(y.astype(jnp.float32), axis=1, keepdims=True).astype(x.dtype) * 0
        return x
    return run


def time_path(fn, x, weights, repeats: int) -> float:
    run = chained(fn)
    return median_time(lambda: run(x, weights).block_until_ready(), repeats) / len(weights)


@jax.jit
def _reference(x, w):
    return jnp.einsum("mk,nk->mn", x.astype(jnp.float32), w.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def check(fn, x, w) -> float:
    """Largest |error| of fn against the float32 product (on the device: an lm_head's
    product is too large for a host check), over the largest |reference|."""
    want = _reference(x, w)
    got = jax.jit(fn)(x, w).astype(jnp.float32)
    return float(jnp.abs(got - want).max() / jnp.maximum(jnp.abs(want).max(), 1e-30))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default="preset:qwen3-8b", help="preset:NAME (shapes only)")
    p.add_argument("--rows", type=int, nargs="+", default=[8, 32, 128, 256, 512])
    p.add_argument("--paths", nargs="+", default=["xla", "split-k2", "split-k4"])
    p.add_argument("--only", nargs="+", default=None, help="products to time (default: all)")
    p.add_argument("--layers", type=int, default=8, help="distinct weights per program")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--interpret", action="store_true", help="Pallas paths in interpret mode")
    p.add_argument("--out", default=None, help="append one JSON line per product, rows, path")
    return p.parse_args(argv)


def main(argv=None):
    from dspine_jax.config import PRESETS
    from pallas_kernels.split_k_matmul import fits as split_k_fits

    args = parse_args(argv)
    name = args.target.removeprefix("preset:")
    if name not in PRESETS:
        raise SystemExit(f"--target: no preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    for path in args.paths:
        if not (path == "xla" or pallas_overrides(path) is not None or
                (path.startswith("split-k") and path.removeprefix("split-k").isdigit())):
            raise SystemExit(f"--paths: {path!r} is none of xla, split-kS, "
                             "pallas[-sS][-nBN][-kBK][-wW][-pP] (integers)")
    config = PRESETS[name]
    shapes = [s for s in projections(config) if args.only is None or s[0] in args.only]
    dtype = jnp.dtype(args.dtype)
    bandwidth = jax_copy_bandwidth()
    device = jax.devices()[0].device_kind
    print(f"{device}, {args.target}, copy {bandwidth / 1e9:.0f} GB/s, "
          f"{args.layers} weights per program, median of {args.repeats}")
    print(f"{'product':8s} {'N x K':>14s} {'rows':>5s} {'path':>20s} {'us':>9s} "
          f"{'GB/s':>7s} {'% copy':>7s} {'TFLOP/s':>8s}")
    key = jax.random.key(0)
    for label, n, k in shapes:
        weights = tuple((jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.float32)
                         * 0.02).astype(dtype) for i in range(args.layers))
        for m in args.rows:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(dtype)
            for path in args.paths:
                slices = (int(path.removeprefix("split-k")) if path.startswith("split-k")
                          else 1)
                if k % slices or (path.startswith("pallas") and not split_k_fits(
                        m, n, k, pallas_tiling(path, m, n, k))):
                    continue
                fn = product(path, args.interpret)
                try:
                    error = check(fn, x, weights[0])
                except jax.errors.JaxRuntimeError as e:      # a tile that does not fit
                    print(f"{label:8s} {f'{n} x {k}':>14s} {m:5d} {path:>20s} "
                          f"does not run: {str(e).splitlines()[0][:80]}")
                    continue
                if error > 2e-2:
                    raise SystemExit(f"{label} rows {m} {path}: relative error {error:.3g}")
                seconds = time_path(fn, x, weights, args.repeats)
                read = n * k * dtype.itemsize
                row = {"product": label, "n": n, "k": k, "rows": m, "path": path,
                       "us": seconds * 1e6, "weight_gb_s": read / seconds / 1e9,
                       "copy_gb_s": bandwidth / 1e9, "tflop_s": 2 * m * n * k / seconds / 1e12,
                       "relative_error": error, "device": device, "target": args.target,
                       "jax": jax.__version__, "date": datetime.date.today().isoformat()}
                print(f"{label:8s} {f'{n} x {k}':>14s} {m:5d} {path:>20s} {row['us']:9.1f} "
                      f"{row['weight_gb_s']:7.0f} {100 * read / seconds / bandwidth:6.1f}% "
                      f"{row['tflop_s']:8.1f}")
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
        del weights


if __name__ == "__main__":
    main()
