"""Time `pallas_kernels.top_k.top_k` over vocabulary rows, each path side by side.

    python -m dspine_benchmarks.top_k_rows --out top_k_rows.jsonl          # GPU
    python -m dspine_benchmarks.top_k_rows --rows 15 --vocab 4096 --iters 4  # CPU smoke

The rows are DSpine's proposal (one per drafted slot: batch x 15) over SmolLM2's and
Qwen3's vocabularies, float32 logits, k = 16. Paths: `lax` (one lax.top_k), `split` (two
stages), `grouped-topk` (the grouped path, XLA's TopK for its two selections) and
`grouped-sort` (the grouped path, a sort for each). Each
path runs `--iters` times in one compiled loop (each iteration's input depends on the
last result, so nothing is hoisted) and the figure is the median over `--repeats` of
(loop time / iters), in microseconds: device time, the loop's one dispatch spread over
its iterations. The floor is one read
of the logits at the copy bandwidth measured in the same run. Every path's ids are checked
against lax.top_k's before timing.
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp
import numpy as np

from dspine_benchmarks.decode_step import jax_copy_bandwidth, median_time
from pallas_kernels import top_k as long_rows
from pallas_kernels.platform import multiprocessors
from pallas_kernels.switches import Switches

K = 16


def paths(rows: int, vocab: int, multiprocessors: int):
    """(name, function of x [rows, vocab] -> (values, ids)) for each path, each with
    top_k's own group and chunk rules (a split that top_k would not take is at least 2
    chunks here)."""
    group = long_rows.group_length(vocab, K)
    chunk = (long_rows.chunk_length(rows, vocab, K, multiprocessors)
             or long_rows.chunk_length(1, vocab, K, 2))
    return [
        ("lax", lambda x: jax.lax.top_k(x, K)),
        ("split", lambda x: long_rows.two_stage_top_k(x, K, chunk)),
        ("grouped-topk", lambda x: _with(Switches(top_k_select="topk"),
                                         long_rows.grouped_top_k, x, K, group)),
        ("grouped-sort", lambda x: _with(Switches(top_k_select="sort"),
                                         long_rows.grouped_top_k, x, K, group)),
    ]


def _with(switches, fn, *args):
    with switches.active():
        return fn(*args)


def looped(fn, iters: int):
    """A jitted loop of `iters` calls of fn, each on x nudged by the last result."""
    @jax.jit
    def run(x):
        def body(_, carry):
            values, _ = fn(x + carry)
            return values[0, -1] * 0
        return jax.lax.fori_loop(0, iters, body, jnp.zeros((), x.dtype))
    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[15, 120])
    p.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="append one JSON line per row and path")
    args = p.parse_args(argv)

    gbps = jax_copy_bandwidth() / 1e9
    sms = multiprocessors()
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, copy {gbps:.0f} GB/s")
    print(f"{'rows':>5} {'vocab':>7} {'path':<13} {'us':>8} {'floor us':>9}")
    rng = np.random.default_rng(0)
    for vocab in args.vocab:
        for rows in args.rows:
            x = jnp.asarray(rng.standard_normal((rows, vocab)), jnp.float32)
            want = np.asarray(jax.lax.top_k(x, K)[1])
            floor = x.nbytes / (gbps / 2) / 1e3
            for name, fn in paths(rows, vocab, sms):
                got = np.asarray(jax.jit(fn)(x)[1])
                if not np.array_equal(got, want):
                    raise SystemExit(f"{name} at {rows} x {vocab}: ids differ from lax.top_k")
                run = looped(fn, args.iters)
                us = median_time(lambda: run(x).block_until_ready(), args.repeats) / (
                    args.iters * 1e-6)
                print(f"{rows:>5} {vocab:>7} {name:<13} {us:>8.1f} {floor:>9.1f}", flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps({
                            "rows": rows, "vocab": vocab, "k": K, "path": name, "us": us,
                            "floor_us": floor, "copy_GBps": gbps, "iters": args.iters,
                            "repeats": args.repeats, "device": jax.devices()[0].device_kind,
                            "jax": jax.__version__,
                            "date": datetime.date.today().isoformat()}) + "\n")


if __name__ == "__main__":
    main()
