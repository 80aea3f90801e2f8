"""Time dspine_torch's Triton kernels against their PyTorch references, and the PyTorch
speculative loop's tokens/s at batch 1 and 8.

    PYTHONPATH=. python benchmarks/torch_kernels.py --out torch_kernels.json      # CUDA
    PYTHONPATH=. python benchmarks/torch_kernels.py --quick --out quick.json      # < 60 s
    PYTHONPATH=. python benchmarks/torch_kernels.py --device cpu                  # smoke

Every row is printed (flushed) as it is measured and, with --out, the JSON file is
rewritten after every row, so a run cut short shows and keeps what it measured.
`--quick`: the SmolLM2 shape only, fewer calls per timing, a short loop, and a 50 s
budget after which the remaining measurements are skipped (each skip is printed).

Kernels (bf16 weights and hidden states, float32 logits), per shape and batch (1, 8):
  vocab_topk      top-C per drafted slot from the final hidden states and the lm_head
                  (the reference materialises [B * (K-1), V] float32 logits, then topk)
  transition      the C x C transition table of every slot (write, norm, C lm_head rows)
  chain_walk      the walk over K-1 slots at T = 0 and at T = 0.8 / top-p 0.9 / top-k 20
  injection       one drafter layer's gated write (readout matmul + fused kernel)
  acceptance      the verification rule of a block over the target's [B, K, V] logits,
                  T = 0 and T = 0.8 with sparse q
Shapes: Qwen3-8B-like (D 4096, V 151936, r 512, m 256, K 16, C 16) and SmolLM2-135M
(D 576, V 49152, r 512, m 256, K 16, C 16); `--device cpu` uses a tiny shape (D 64,
V 512, r 16, m 8, K 5, C 4) and Triton's interpreter (its timings mean nothing; it checks
that the script runs).

Timing: CUDA events around n back-to-back calls after a warm-up, median of repeats, in
microseconds per call. Bytes per call = what the op must read and write at least (the
lm_head for vocab_topk, the logits for acceptance, the layer's weights and hidden states
for injection, ...); GB/s is that over the time and "% copy" its share of a measured
device-to-device copy (read + write bytes of a 1 GiB copy).

The loop: `dspine_torch.speculative.generate_batch` on the golden fixtures' tiny target
and drafters (tests/fixtures/torch_port), batch 1 and 8 (ragged prompts), T = 0 and
T = 0.8, implementation torch vs triton; tokens/s (all rows) over 64 new tokens per row,
after one warm-up generation. At these sizes the figure is
the loop's per-step overhead (Python, launches, host syncs), not model compute.

Imports only torch, triton, transformers (for the loop), dspine_torch and the plain-Python
`kernel_cases` it shares with `jax_kernels.py` (shapes, byte counts, run plan).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

from dspine_benchmarks.kernel_cases import SHAPES, QuickBudget, op_bytes, plan

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "torch_port"


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shapes", default=None, help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--batches", default=None, help="comma list (default 1,8; cpu: 1)")
    ap.add_argument("--iters", type=int, default=None, help="calls per timing (default 50)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-loop", action="store_true")
    ap.add_argument("--loop-batches", default="1,8", help="comma list of loop batch sizes")
    ap.add_argument("--quick", action="store_true",
                    help="SmolLM2 shape, few calls, short loop, 50 s budget (< 60 s total)")
    ap.add_argument("--out", default=None, help="write the rows as JSON (after every row)")
    return ap.parse_args()


def main():
    args = parse()
    sys.stdout.reconfigure(line_buffering=True)        # one flushed line per row
    budget = QuickBudget(args.quick)
    over_budget = budget.spent

    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu for the smoke run")
    import triton

    from dspine_torch.kernels import acceptance, dspine_proposal, gated_injection
    from dspine_torch.kernels.dspine_proposal import ChainHead

    device = torch.device(args.device)
    cpu = args.device == "cpu"
    shapes, batches, iters, repeats = plan(args, cpu)
    bf16 = torch.bfloat16

    def timed(fn) -> float:
        """Microseconds per call: median over repeats of (n calls) / n."""
        fn()
        if not cpu:
            torch.cuda.synchronize()
        samples = []
        for _ in range(repeats):
            if cpu:
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                samples.append((time.perf_counter() - t0) / iters * 1e6)
            else:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                for _ in range(iters):
                    fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) / iters * 1e3)
        return statistics.median(samples)

    copy_gbs = None
    if not cpu:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        us = timed(lambda: dst.copy_(src))
        copy_gbs = 2 * src.numel() / us / 1e3
        del src, dst
    print(f"device: {torch.cuda.get_device_name() if not cpu else 'cpu (Triton interpreter)'}; "
          f"torch {torch.__version__}, triton {triton.__version__}; copy bandwidth "
          f"{copy_gbs and round(copy_gbs)} GB/s")

    rows, loop_rows = [], []
    meta = {"date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name() if not cpu else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "copy_gbs": copy_gbs,
            "quick": args.quick}

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps({**meta, "kernels": rows, "loop": loop_rows},
                                                 indent=1))

    def record(shape, batch, op, variant, ref_us, tri_us):
        nbytes = op_bytes(op, SHAPES[shape], batch)
        row = dict(shape=shape, batch=batch, op=op, variant=variant, torch_us=round(ref_us, 1),
                   triton_us=round(tri_us, 1), speedup=round(ref_us / tri_us, 2),
                   bytes=int(nbytes), triton_gbs=round(nbytes / tri_us / 1e3, 1),
                   torch_gbs=round(nbytes / ref_us / 1e3, 1))
        if copy_gbs:
            row["triton_pct_copy"] = round(100 * row["triton_gbs"] / copy_gbs, 1)
        rows.append(row)
        print(f"{shape:13s} bs{batch:<2d} {op:11s} {variant:10s} torch {ref_us:9.1f} us  "
              f"triton {tri_us:9.1f} us  x{ref_us / tri_us:5.2f}  "
              f"{row['triton_gbs']:8.1f} GB/s" + (f" ({row['triton_pct_copy']}% copy)"
                                                  if copy_gbs else ""))
        save()

    g = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    for name in shapes:
        s = SHAPES[name]
        d, v, r, m, k, c = s["d"], s["v"], s["r"], s["m"], s["k"], s["c"]
        lm_head = randn(v, d, dtype=bf16, scale=0.02)
        head = ChainHead(readout=randn(r, d, dtype=bf16, scale=0.02),
                         receiver_gate=randn(m, r, dtype=bf16, scale=0.05),
                         predecessor_gate=randn(m, r, dtype=bf16, scale=0.05),
                         bias=randn(m, dtype=bf16), message=randn(m, r, dtype=bf16, scale=0.05),
                         write=randn(d, m, dtype=bf16, scale=0.05),
                         norm_weight=torch.ones(d, dtype=bf16, device=device), eps=1e-6,
                         whiten=randn(d, r, scale=0.1), mean=randn(d, scale=0.01))
        for batch in batches:
            if over_budget(f"kernels {name} bs{batch}"):
                continue
            print(f"{name} bs{batch}: timing kernels")
            n = batch * (k - 1)
            hidden = randn(n, d, dtype=bf16)
            both = {impl: (lambda impl=impl: dspine_proposal.vocab_topk(
                hidden, lm_head, c, implementation=impl)) for impl in ("torch", "triton")}
            record(name, batch, "vocab_topk", f"C={c}", timed(both["torch"]),
                   timed(both["triton"]))
            _, ids = dspine_proposal.vocab_topk(hidden, lm_head, c)
            preds = ids.roll(1, 0)
            gu = dspine_proposal.gated_messages(head, hidden, preds, lm_head)
            both = {impl: (lambda impl=impl: dspine_proposal.transition_table(
                head, hidden, gu, ids, lm_head, implementation=impl))
                for impl in ("torch", "triton")}
            record(name, batch, "transition", f"C={c}", timed(both["torch"]),
                   timed(both["triton"]))
            table = dspine_proposal.transition_table(head, hidden, gu, ids, lm_head)
            table = table.reshape(batch, k - 1, c, c)
            cands = ids.reshape(batch, k - 1, c)
            u = torch.rand(batch, k - 1, generator=g).to(device)
            for variant, warp in (("T=0", (0.0, 1.0, 0)), ("T=0.8", (0.8, 0.9, 20))):
                both = {impl: (lambda impl=impl: dspine_proposal.chain_walk(
                    table, cands, *warp, u, implementation=impl)) for impl in ("torch", "triton")}
                record(name, batch, "chain_walk", variant, timed(both["torch"]),
                       timed(both["triton"]))
            h = randn(batch, k, d, dtype=bf16)
            code = randn(batch, r)
            weights = (head.readout, head.receiver_gate, head.predecessor_gate, head.bias,
                       head.message, head.write)
            both = {impl: (lambda impl=impl: gated_injection.inject(
                h, code, *weights, implementation=impl)) for impl in ("torch", "triton")}
            record(name, batch, "injection", f"r={r},m={m}", timed(both["torch"]),
                   timed(both["triton"]))
            logits = randn(batch, k, v, scale=3.0)
            draft = logits[:, :-1].argmax(-1)
            draft[:, k // 2] = (draft[:, k // 2] + 1) % v
            probs = torch.softmax(randn(batch, k - 1, c), -1)
            q_ids = torch.cat([draft[..., None], ids.reshape(batch, k - 1, c)[..., 1:]], -1)
            u_a, u_n = torch.rand(batch, k - 1).to(device), torch.rand(batch).to(device)
            for variant, temp in (("T=0", 0.0), ("T=0.8", 0.8)):
                both = {impl: (lambda impl=impl: acceptance.accept(
                    logits, draft, q_ids, probs, temp, 1.0, 0, u_a, u_n, implementation=impl))
                    for impl in ("torch", "triton")}
                record(name, batch, "acceptance", variant, timed(both["torch"]),
                       timed(both["triton"]))
            logits = None        # frees the device memory before the next shape
        lm_head = None

    if not args.skip_loop:
        loop_batches = [int(b) for b in args.loop_batches.split(",")]
        loop_tokens_per_second(device, cpu, loop_batches, 32 if args.quick else None,
                               loop_rows, save, over_budget)
    save()
    print(f"done in {time.perf_counter() - budget.start:.1f} s")


def loop_tokens_per_second(device, cpu: bool, batches, new_tokens, rows, save, over_budget):
    import torch
    import transformers

    from dspine_torch import load_drafter
    from dspine_torch.speculative import Sampling, generate_batch

    sys.path.insert(0, str(FIXTURES.parents[2]))
    from tests.torch_port_golden import PROMPTS

    target = transformers.AutoModelForCausalLM.from_pretrained(
        FIXTURES / "target", dtype=torch.float32).eval().to(device)
    new = new_tokens or (16 if cpu else 64)
    # Ragged prompts: the fixture prompts and their prefixes, cycled.
    pool = [p[:len(p) - i] for i in range(3) for p in PROMPTS]
    for batch in batches:
        prompts = [pool[i % len(pool)] for i in range(batch)]
        for kind in ("dflash", "dspine"):
            drafter = load_drafter(FIXTURES / kind).to(device)
            for temperature in (0.0, 0.8):
                sampling = Sampling(temperature=temperature,
                                    top_p=0.95 if temperature else 1.0)
                for impl in ("torch", "triton"):
                    if over_budget(f"loop bs{batch} {kind} T={temperature} {impl}"):
                        continue

                    def run(prompts=prompts, drafter=drafter, sampling=sampling, impl=impl):
                        return generate_batch(target, drafter, prompts, max_new_tokens=new,
                                              sampling=sampling, seed=0, ignore_eos=True,
                                              implementation=impl)
                    run()
                    if not cpu:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    gens = run()
                    if not cpu:
                        torch.cuda.synchronize()
                    seconds = time.perf_counter() - t0
                    tokens = sum(len(g.tokens) for g in gens)
                    passes = sum(len(g.accept_lengths) for g in gens)
                    row = dict(batch=batch, drafter=kind, temperature=temperature,
                               implementation=impl, tokens=tokens, seconds=round(seconds, 4),
                               tokens_per_s=round(tokens / seconds, 1),
                               tokens_per_verify=round(tokens / max(1, passes), 2))
                    rows.append(row)
                    print(f"loop bs{batch:<2d} {kind:7s} T={temperature:<4} {impl:7s} "
                          f"{row['tokens_per_s']:8.1f} tok/s  tau {row['tokens_per_verify']}")
                    save()
    return rows


if __name__ == "__main__":
    main()
