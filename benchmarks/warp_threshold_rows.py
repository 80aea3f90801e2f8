"""Time `pallas_kernels.warp_threshold` over vocabulary rows, each implementation side by
side.

    python -m dspine_benchmarks.warp_threshold_rows --out warp_threshold_rows.jsonl    # GPU
    python -m dspine_benchmarks.warp_threshold_rows --rows 16 --vocab 4096 --iters 2 \
        --implementations sort search pallas_gpu --interpret                         # CPU smoke

The rows are an AR step's (one per batch row: 1 and 8) and a verify's (one per verified
position: batch x 16; 16, 128 and 512 for batch 1, 8 and 32; the GPU warp searches with
the kernel at every count by default), over SmolLM2's and Qwen3's vocabularies, float32
logits scaled as at temperature 0.8, top-p 0.9 (`--top-k` adds a top-k to every row).
Each implementation runs `--iters` times in one compiled loop (each iteration's input
depends on the last result, so nothing is hoisted); the figure is the median over
`--repeats` of (loop time / iters), in microseconds of device time. Beside it: one read
of the rows at the copy bandwidth measured in the same run (the search reads them about
10 times: 8 rounds, the extremes and the top-k set's mass; the sort reads and writes them
several times). Every implementation's kept set is checked against the sort's before
timing (equal but for tokens whose mass-before lies within float32 rounding of top_p).
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp
import numpy as np

from dspine_benchmarks.decode_step import jax_copy_bandwidth, median_time
from pallas_kernels.warp_threshold import IMPLEMENTATIONS, warp_threshold
from pallas_kernels.warp_threshold.search import WAYS

TOP_P = 0.9
TEMPERATURE = 0.8


def rounding_only(x: np.ndarray, tau: np.ndarray, want: np.ndarray, k: int,
                  top_p: float, tolerance: float = 1e-5) -> bool:
    """Whether thresholds tau and want [R] of rows x [R, V] keep the same tokens but for
    those whose mass before them (float64, in sorted order over the top-k set) lies within
    `tolerance` of top_p: where float32 sums in another order may round either way."""
    for r in np.flatnonzero(tau != want):
        vals = np.sort(x[r].astype(np.float64))[::-1][:k]
        probs = np.exp(vals - vals[0])
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        lo, hi = sorted((float(tau[r]), float(want[r])))
        between = (vals >= lo) & (vals < hi)               # kept by one of the two only
        if not np.all(np.abs(before[between] - top_p) < tolerance):
            return False
    return True


def looped(fn, iters: int):
    """A jitted loop of `iters` calls of fn, each on x nudged by the last result."""
    @jax.jit
    def run(x):
        def body(_, carry):
            return fn(x + carry)[0] * 0
        return jax.lax.fori_loop(0, iters, body, jnp.zeros((), x.dtype))
    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 128, 512])
    p.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    p.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS,
                   default=list(IMPLEMENTATIONS))
    p.add_argument("--ways", type=int, nargs="+", default=[WAYS],
                   help="the searches' candidates per round, each timed (powers of two)")
    p.add_argument("--top-k", type=int, default=0, help="a top-k on every row (0: none)")
    p.add_argument("--interpret", action="store_true",
                   help="run the Pallas kernel in interpret mode (CPU smoke runs)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="append one JSON line per shape and path")
    args = p.parse_args(argv)
    if "pallas_gpu" in args.implementations and not args.interpret \
            and jax.default_backend() != "gpu":
        p.error("pallas_gpu runs on a CUDA GPU; pass --interpret elsewhere")

    gbps = jax_copy_bandwidth() / 1e9
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, copy {gbps:.0f} GB/s")
    print(f"{'rows':>5} {'vocab':>7} {'implementation':<14} {'ways':>4} {'us':>9} "
          f"{'one read us':>12}")
    variants = [(name, ways) for name in args.implementations
                for ways in ([None] if name == "sort" else args.ways)]
    rng = np.random.default_rng(0)
    for vocab in args.vocab:
        for rows in args.rows:
            # [rows, V] logits of a peaked-ish model at T = 0.8
            x = jnp.asarray(rng.standard_normal((rows, vocab)) * 3 / TEMPERATURE, jnp.float32)
            k = jnp.full((rows,), args.top_k or vocab, jnp.int32)
            top_p = jnp.full((rows,), TOP_P, jnp.float32)
            read_us = x.nbytes / (gbps / 2) / 1e3
            first = None
            for name, ways in variants:
                fn = jax.jit(lambda x, name=name, ways=ways: warp_threshold(
                    x, k, top_p, implementation=name, ways=ways or WAYS,
                    interpret=args.interpret))
                tau = np.asarray(fn(x))
                if first is None:
                    first = tau
                elif not rounding_only(np.asarray(x), tau, first, int(k[0]), TOP_P):
                    raise SystemExit(f"{name} (ways {ways}) at {rows} x {vocab}: kept sets "
                                     f"differ from {variants[0][0]}'s")
                run = looped(fn, args.iters)
                us = median_time(lambda: run(x).block_until_ready(), args.repeats) / (
                    args.iters * 1e-6)
                print(f"{rows:>5} {vocab:>7} {name:<14} {ways or '-':>4} {us:>9.1f} "
                      f"{read_us:>12.1f}", flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps({
                            "rows": rows, "vocab": vocab, "implementation": name,
                            "ways": ways,
                            "top_p": TOP_P, "top_k": args.top_k, "us": us,
                            "one_read_us": read_us, "copy_GBps": gbps, "iters": args.iters,
                            "repeats": args.repeats, "interpret": args.interpret,
                            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                            "date": datetime.date.today().isoformat()}) + "\n")


if __name__ == "__main__":
    main()
