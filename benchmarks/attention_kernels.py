"""Time ragged paged attention on one GPU: the XLA reference, our Pallas GPU kernel, JAX's
shipped Pallas GPU decode kernels; achieved bandwidth as a share of a measured copy.

    PYTHONPATH=. python benchmarks/attention_kernels.py --out attn.json

Shapes: batch 1/8/32 x context 1k/8k/32k keys per row (kv_lens after the call's write),
Qwen3-8B attention (N=32, K=8, H=128) and SmolLM2-135M attention (N=9, K=3, H=64), bf16,
page size 16, page tables shuffled; modes decode (T=1, causal), verify (T=16, causal),
draft (T=16, bidirectional). Each call writes its T tokens and attends (the whole op).

Timing: each implementation runs n back-to-back calls inside one jitted fori_loop (pools
carried, so the write is in place and nothing is hoisted), after a warm-up; the figure is
the median over repetitions of (loop time / n), in microseconds per call. Bytes per call =
K/V actually needed (B * kv_len * K * H * 2 * 2 bytes) + q + out; GB/s is that over the
time, and "% copy" is that over a device-to-device copy's bandwidth (read + write bytes
of a 4 GiB copy). The shipped kernels (`jax.experimental.pallas.ops.gpu.decode_attention.gqa`
on a dense [B, S, K, H] cache, `paged_attention.paged_attention` on head-major pages
[K, P, PS, H]) only do T=1 without a write, so they appear in decode rows only.

Imports only pallas_kernels, jax and numpy.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import ragged_paged_attention
from pallas_kernels.ragged_paged_attention import gpu as rpa_gpu

MODELS = {"qwen3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
MODES = {"decode": (1, "causal"), "verify": (16, "causal"), "draft": (16, "bidirectional")}
PAGE_SIZE = 16
DTYPE = jnp.bfloat16


def timed(fn, state, target_s=0.03, reps=5):
    """Median seconds per call; fn(*state, n) runs the op n times and returns the new state
    (the donated pools come back, so each call feeds the next)."""
    state = jax.block_until_ready(fn(*state, 2))           # compile + warm-up
    t0 = time.perf_counter()
    state = jax.block_until_ready(fn(*state, 2))
    per = max((time.perf_counter() - t0) / 2, 1e-6)
    n = int(min(2000, max(3, target_s / per)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        state = jax.block_until_ready(fn(*state, n))
        times.append((time.perf_counter() - t0) / n)
    return float(np.median(times)), n


def copy_bandwidth(gib=4):
    x = jnp.arange(gib * 2**30 // 4, dtype=jnp.int32)

    @functools.partial(jax.jit, donate_argnums=0)
    def loop(x, n):
        return (lax.fori_loop(0, n, lambda i, y: y ^ i, x),)   # one read + one write a pass
    sec, _ = timed(loop, (x,), target_s=0.2)
    return 2 * x.nbytes / sec / 1e9


def make_inputs(key, b, ctx, t, n, k, h):
    num_pages = b * ctx // PAGE_SIZE
    ks = jax.random.split(key, 6)
    rnd = lambda kk, shape: jax.random.normal(kk, shape, jnp.float32).astype(DTYPE)
    pool = (num_pages, PAGE_SIZE, k, h)
    return dict(
        q=rnd(ks[0], (b, t, n, h)), new_k=rnd(ks[1], (b, t, k, h)),
        new_v=rnd(ks[2], (b, t, k, h)), k_pages=rnd(ks[3], pool), v_pages=rnd(ks[4], pool),
        page_table=jax.random.permutation(ks[5], num_pages).astype(jnp.int32)
        .reshape(b, ctx // PAGE_SIZE),
        kv_lens=jnp.full((b,), ctx, jnp.int32), q_lens=jnp.full((b,), t, jnp.int32))


def op_loop(mask, implementation, **kernel_kw):
    """jit(fori_loop of n calls) with the pools carried (donated)."""
    if kernel_kw:
        call = functools.partial(rpa_gpu.ragged_paged_attention_gpu, mask=mask, **kernel_kw)
    else:
        call = functools.partial(ragged_paged_attention, mask=mask,
                                 implementation=implementation)

    @functools.partial(jax.jit, donate_argnums=(3, 4))
    def loop(q, new_k, new_v, k_pages, v_pages, page_table, kv_lens, q_lens, acc, n):
        def body(i, carry):
            kp, vp, acc = carry
            out, kp, vp = call(q + acc.astype(q.dtype), new_k, new_v, kp, vp, page_table,
                               kv_lens, q_lens)
            return kp, vp, acc + out[0, 0, 0, 0].astype(jnp.float32) * 1e-30
        kp, vp, acc = lax.fori_loop(0, n, body, (k_pages, v_pages, acc))
        return q, new_k, new_v, kp, vp, page_table, kv_lens, q_lens, acc
    return loop


def shipped_loop(kind):
    from jax.experimental.pallas.ops.gpu import decode_attention, paged_attention

    @jax.jit
    def loop(q, k, v, page_table, kv_lens, acc, n):
        def body(i, acc):
            qi = (q + acc.astype(q.dtype))[:, 0]                     # [B, N, H]
            if kind == "jax_paged_attention":
                out = paged_attention.paged_attention(qi, k, v, page_table, kv_lens)
            else:
                out = decode_attention.gqa(qi, k, v, kv_seq_len=kv_lens)
            return acc + out[0, 0, 0].astype(jnp.float32) * 1e-30
        return q, k, v, page_table, kv_lens, lax.fori_loop(0, n, body, acc)
    return loop


def run_cell(model, b, ctx, mode, impls, copy_gbs, key):
    n, k, h = MODELS[model]
    t, mask = MODES[mode]
    itemsize = jnp.dtype(DTYPE).itemsize
    nbytes = b * ctx * k * h * 2 * itemsize + 2 * b * t * n * h * itemsize
    rows = []
    for impl in impls:
        if impl.startswith("jax_") and mode != "decode":
            continue
        row = dict(model=model, batch=b, context=ctx, mode=mode, impl=impl, bytes=nbytes)
        try:
            x = make_inputs(key, b, ctx, t, n, k, h)
            if impl.startswith("jax_"):
                # the shipped kernels' own layouts (built outside the timed loop)
                if impl == "jax_paged_attention":
                    kk = x["k_pages"].transpose(2, 0, 1, 3)
                    vv = x["v_pages"].transpose(2, 0, 1, 3)
                    args = (x["q"], kk, vv, x["page_table"], x["kv_lens"], jnp.float32(0))
                else:
                    dense = lambda p: p[x["page_table"]].reshape(b, ctx, k, h)
                    args = (x["q"], dense(x["k_pages"]), dense(x["v_pages"]),
                            x["page_table"], x["kv_lens"], jnp.float32(0))
                del x
                fn = shipped_loop(impl)
            else:
                args = tuple(x[a] for a in ("q", "new_k", "new_v", "k_pages", "v_pages",
                                            "page_table", "kv_lens", "q_lens"))
                args += (jnp.float32(0),)
                del x
                fn = op_loop(mask, impl)
            sec, iters = timed(fn, args)
            gbs = nbytes / sec / 1e9
            row.update(us=sec * 1e6, gbs=gbs, pct_copy=100 * gbs / copy_gbs, iters=iters)
        except Exception as e:                                     # keep the other cells
            row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# (model, mode, batch, block_n, num_warps, num_stages, split multiplier) at 32k context:
# candidates around the defaults, to tune default_config
SWEEP = [
    ("qwen3-8b", "verify", 8, 64, 4, 2, 1), ("qwen3-8b", "verify", 8, 64, 4, 3, 1),
    ("qwen3-8b", "verify", 8, 64, 4, 4, 1), ("qwen3-8b", "verify", 8, 32, 4, 4, 1),
    ("qwen3-8b", "verify", 8, 64, 4, 3, 2),
    ("qwen3-8b", "verify", 1, 64, 4, 3, 1), ("qwen3-8b", "verify", 1, 64, 4, 3, 2),
    ("qwen3-8b", "verify", 1, 32, 4, 4, 2),
    ("qwen3-8b", "verify", 32, 64, 4, 3, 1), ("qwen3-8b", "verify", 32, 64, 4, 3, 0.5),
    ("qwen3-8b", "decode", 1, 64, 4, 3, 1), ("qwen3-8b", "decode", 1, 64, 4, 4, 1),
    ("qwen3-8b", "decode", 1, 64, 4, 3, 2), ("qwen3-8b", "decode", 1, 64, 4, 3, 4),
    ("qwen3-8b", "decode", 1, 128, 4, 3, 1),
    ("qwen3-8b", "decode", 8, 64, 4, 2, 1), ("qwen3-8b", "decode", 8, 64, 4, 3, 1),
    ("smollm2-135m", "verify", 8, 128, 4, 3, 1), ("smollm2-135m", "verify", 8, 128, 4, 4, 1),
    ("smollm2-135m", "decode", 1, 128, 4, 3, 1), ("smollm2-135m", "decode", 1, 128, 4, 3, 2),
]


def sweep(copy_gbs, key, models, modes):
    """SWEEP's kernel configs (those of the given models and modes) at 32k context."""
    rows = []
    ctx = 32768
    for model, mode, b, bn, warps, stages, split_mul in SWEEP:
        if model not in models or mode not in modes:
            continue
        n, k, h = MODELS[model]
        t, mask = MODES[mode]
        base = rpa_gpu.default_config(b, t, n, h, k, PAGE_SIZE, ctx // PAGE_SIZE, DTYPE)
        nbytes = b * ctx * k * h * 4 + 4 * b * t * n * h
        cfg = dict(block_n=bn, num_warps=warps, num_stages=stages,
                   num_splits=max(1, int(base[2] * split_mul)))
        row = dict(model=model, batch=b, context=ctx, mode=mode, default=list(base), **cfg)
        try:
            x = make_inputs(key, b, ctx, t, n, k, h)
            args = tuple(x[a] for a in ("q", "new_k", "new_v", "k_pages", "v_pages",
                                        "page_table", "kv_lens", "q_lens"))
            args += (jnp.float32(0),)
            del x
            sec, _ = timed(op_loop(mask, "pallas_gpu", **cfg), args)
            row.update(us=sec * 1e6, pct_copy=100 * nbytes / sec / 1e9 / copy_gbs)
        except Exception as e:
            row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        print("sweep", json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attention_kernels.json")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--impls", default="xla,pallas_gpu,jax_paged_attention,jax_decode_gqa")
    ap.add_argument("--sweep", action="store_true", help="also time SWEEP's kernel configs")
    ap.add_argument("--no-table", action="store_true", help="skip the table (with --sweep)")
    a = ap.parse_args()
    dev = jax.devices()[0]
    copy_gbs = copy_bandwidth()
    meta = dict(date=datetime.date.today().isoformat(), jax=jax.__version__,
                device=dev.device_kind, copy_gbs=copy_gbs, page_size=PAGE_SIZE,
                dtype=jnp.dtype(DTYPE).name)
    print(json.dumps(meta), flush=True)
    key = jax.random.key(0)
    rows = []
    for model in a.models.split(",") if not a.no_table else []:
        for mode in a.modes.split(","):
            for b in map(int, a.batches.split(",")):
                for ctx in map(int, a.contexts.split(",")):
                    rows += run_cell(model, b, ctx, mode, a.impls.split(","), copy_gbs, key)
    sweep_rows = (sweep(copy_gbs, key, a.models.split(","), a.modes.split(","))
                  if a.sweep else [])
    with open(a.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows, sweep=sweep_rows), f, indent=1)

    impls = a.impls.split(",")
    print(f"\n{meta['device']}, JAX {meta['jax']}, {meta['date']}, bf16, page size "
          f"{PAGE_SIZE}; copy bandwidth {copy_gbs:.0f} GB/s. Cells: us per call / % of copy "
          "bandwidth.\n")
    print("| model | mode | batch | context | " + " | ".join(impls) + " |")
    print("|" + "---|" * (4 + len(impls)))
    table = {(r["model"], r["mode"], r["batch"], r["context"], r["impl"]): r for r in rows}
    for model in a.models.split(","):
        for mode in a.modes.split(","):
            for b in map(int, a.batches.split(",")):
                for ctx in map(int, a.contexts.split(",")):
                    cells = []
                    for impl in impls:
                        r = table.get((model, mode, b, ctx, impl))
                        cells.append("-" if r is None else "error" if "error" in r
                                     else f"{r['us']:.0f} / {r['pct_copy']:.0f}%")
                    print(f"| {model} | {mode} | {b} | {ctx // 1024}k | " + " | ".join(cells)
                          + " |")
    for r in sweep_rows:
        print("sweep {model} {mode} b{batch} bn{block_n} w{num_warps} s{num_stages} "
              "splits{num_splits} (default {default}): ".format(**r)
              + (r["error"][:120] if "error" in r else f"{r['us']:.0f} us / {r['pct_copy']:.0f}%"))


if __name__ == "__main__":
    main()
