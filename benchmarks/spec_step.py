"""Speculative decoding step time: AR vs DFlash vs DSpine in one engine, split by stage.

  python benchmarks/spec_step.py --target preset:qwen3-8b --batch 1 8 32 --out spec.jsonl
  python benchmarks/spec_step.py --proposal dense sparse --temperature 0 0.8 --top-p 0.9

For each method and batch size it times, on a state after prefill:
  step     the compiled decode loop, `--steps-per-call` target passes per host round
           trip with a host sync after each call (what generate() does), per pass;
  draft    the drafter pass + proposal (DSpine: top-k, transition table, chain walk);
           `--proposal dense` builds q [B, K-1, V] and warps it by sorting the vocabulary,
           `sparse` (the engine's default) keeps q where it is nonzero (DSpine: the
           candidates, from the vocab_top_k kernel on GPU/TPU);
  verify   the target pass over the block + the verification rule (dense: warped p [B, K, V] by
           a sort; sparse: the warp's threshold from a partial top-k, p and q built for
           one row);
  accept   step - draft - verify: cache bookkeeping, context extension, emission.
Drafters are freshly initialised (5 layers at the target's width, block 16): step times do
not depend on their weights, acceptance does, so the implied speedup is reported at
tau = 4, 6, 8 as tau * t_AR / t_step. The floor is the bytes a pass must read (target +
drafter weights and both caches) over the copy bandwidth measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date

import jax
import numpy as np

from dspine_benchmarks.decode_step import jax_copy_bandwidth, load_jax_target, median_time, step_bytes


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default="preset:smollm2-135m")
    p.add_argument("--methods", nargs="+", default=["ar", "dflash", "dspine"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps-per-call", type=int, default=8)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-stages", action="store_true", help="skip the per-stage split")
    p.add_argument("--proposal", nargs="+", default=["sparse"], choices=["dense", "sparse"],
                   help="proposal/verification path(s) of the speculative engine")
    p.add_argument("--proposal-kernel", default="xla",
                   choices=["xla", "auto", "pallas_gpu", "pallas_tpu"],
                   help="vocab_top_k implementation of DSpine's sparse proposal")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0],
                   help="sampling temperature(s); 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p when temperature > 0")
    p.add_argument("--top-k", type=int, default=0, help="top-k when temperature > 0")
    p.add_argument("--out", default=None)
    return p.parse_args()


def make_decoder(method, model, config, args, proposal="sparse"):
    from dspine_jax.drafters.config import DrafterConfig
    from dspine_jax.drafters.model import BlockDrafter
    from dspine_jax.engine import SpeculativeEngine
    from dspine_jax.generate import AutoregressiveGenerator

    if method == "ar":
        return AutoregressiveGenerator(model, steps_per_call=args.steps_per_call), 0
    dconfig = DrafterConfig.for_target(config, kind=method, num_layers=args.draft_layers,
                                       mask_token_id=1, block_size=args.block_size)
    drafter = BlockDrafter.create(dconfig, model.output_embedding(), dtype=model.dtype)
    drafter_params = sum(x.size for x in jax.tree.leaves(
        __import__("flax").nnx.state(drafter)))
    return SpeculativeEngine(model, drafter, steps_per_call=args.steps_per_call,
                             proposal_impl=proposal, proposal_kernel=args.proposal_kernel
                             ), drafter_params


def sampling_options(args, temperature) -> dict:
    if temperature == 0:
        return dict(temperature=0.0)
    return dict(temperature=temperature, top_p=args.top_p, top_k=args.top_k)


def stage_times(decoder, run, b, args, temperature, iterations: int = 16) -> dict:
    """Draft and verify alone, each repeated inside one compiled loop (so dispatch is
    amortised as in the decode loop), each iteration fed by the previous one's output
    so nothing can be hoisted out of the loop."""
    from dspine_jax.sampling import SamplingParams

    params = decoder.params()
    sampling = SamplingParams.create(b, **sampling_options(args, temperature))
    state = run.prefill()
    key = jax.random.key(0)

    @jax.jit
    def drafts(params, state):
        def body(_, anchor):
            return decoder.draft(params, state.replace(last_token=anchor), sampling, key).tokens[:, 0]
        return jax.lax.fori_loop(0, iterations, body, state.last_token)

    proposal = decoder.draft(params, state, sampling, key)

    @jax.jit
    def verifies(params, state, proposal):
        def body(_, tokens):
            verdict, _ = decoder.verify(params, state, proposal.replace(tokens=tokens), sampling,
                                        key)
            return tokens.at[:, 0].set(verdict.next_token)
        return jax.lax.fori_loop(0, iterations, body, proposal.tokens)

    timed = {"draft_ms": lambda: jax.block_until_ready(drafts(params, state)),
             "verify_ms": lambda: jax.block_until_ready(verifies(params, state, proposal))}
    return {k: median_time(fn, args.repeats) / iterations * 1e3 for k, fn in timed.items()}


def bench(method, b, model, config, dtype, bandwidth, args, proposal="sparse", temperature=0.0):
    decoder, drafter_params = make_decoder(method, model, config, args, proposal)
    passes = args.calls * args.steps_per_call
    prompts = np.random.default_rng(0).integers(0, config.vocab_size,
                                                size=(b, args.prompt_len)).tolist()
    # Untrained drafters keep ~1 token per pass: 4 per pass of budget is ample, and keeps
    # the cache capacity (which dense attention reads in full) the same as AR's.
    run = decoder.prepare(prompts, max_new_tokens=4 * (args.calls + 2) * args.steps_per_call,
                          ignore_eos=True, **sampling_options(args, temperature))

    def loop():
        state = run.decode(run.prefill())
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for _ in range(args.calls):
            state = run.decode(state)
            jax.device_get(state.num_generated)
        return (time.perf_counter() - t0) / passes

    loop()
    step = statistics.median(loop() for _ in range(args.repeats))
    itemsize = np.dtype(dtype).itemsize
    context = args.prompt_len + passes
    floor_bytes = step_bytes(config, b, context, itemsize) + drafter_params * itemsize
    row = dict(method=method, batch=b, steps_per_call=args.steps_per_call,
               step_ms=step * 1e3, floor_ms=floor_bytes / bandwidth * 1e3,
               proposal=proposal if method != "ar" else "-", temperature=temperature,
               proposal_kernel=args.proposal_kernel,
               top_p=args.top_p if temperature else 1.0, top_k=args.top_k if temperature else 0)

    if method != "ar" and not args.no_stages:
        row.update(stage_times(decoder, run, b, args, temperature))
        row["accept_ms"] = row["step_ms"] - row["draft_ms"] - row["verify_ms"]
    return row


def main():
    args = parse_args()
    model, config, dtype = load_jax_target(args.target, args.dtype)
    bandwidth = jax_copy_bandwidth()
    rows = []
    runs = [(b, t, method, proposal) for b in args.batch for t in args.temperature
            for method in args.methods
            for proposal in (["-"] if method == "ar" else args.proposal)]
    ar_ms = {}
    for b, temperature, method, proposal in runs:
        row = bench(method, b, model, config, dtype, bandwidth, args,
                    proposal if method != "ar" else "sparse", temperature)
        if method == "ar":
            ar_ms[b, temperature] = row["step_ms"]
        elif (b, temperature) in ar_ms:
            for tau in (4, 6, 8):
                row[f"speedup_tau{tau}"] = tau * ar_ms[b, temperature] / row["step_ms"]
        row.update(target=args.target, prompt_len=args.prompt_len,
                   block_size=args.block_size, draft_layers=args.draft_layers,
                   bandwidth_GBps=bandwidth / 1e9, device=str(jax.devices()[0]),
                   date=str(date.today()))
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(f"\n{'method':8} {'path':6} {'T':>4} {'B':>3} {'step ms':>9} {'floor':>7} "
          f"{'draft':>7} {'verify':>7} {'accept':>7} {'x@tau4':>7} {'x@tau6':>7} {'x@tau8':>7}")
    for r in rows:
        f = lambda k: f"{r[k]:7.2f}" if k in r else "      -"  # noqa: E731
        print(f"{r['method']:8} {r['proposal']:6} {r['temperature']:4.2g} {r['batch']:3d} "
              f"{r['step_ms']:9.3f} {f('floor_ms')} "
              f"{f('draft_ms')} {f('verify_ms')} {f('accept_ms')} {f('speedup_tau4')} "
              f"{f('speedup_tau6')} {f('speedup_tau8')}")


if __name__ == "__main__":
    main()
