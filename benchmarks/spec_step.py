"""Speculative decoding step time: AR vs DFlash vs DSpine in one engine, split by stage.

  python benchmarks/spec_step.py --target preset:qwen3-8b --batch 1 8 32 --out spec.jsonl
  python benchmarks/spec_step.py --target preset:qwen3-8b --batch 1 8 32 \\
      --context 1024 16384 --attention-backend pallas xla
  python benchmarks/spec_step.py --proposal dense sparse --temperature 0 0.8 --top-p 0.9

For each method and batch size it times, on a state after prefill:
  step     the compiled decode loop, `--steps-per-call` target passes per host round
           trip with a host sync after each call (what generate() does), per pass;
  draft    the drafter pass + proposal (DSpine: top-k, transition table, chain walk);
  verify   the target pass over the block + the verification rule;
           `--proposal dense` builds q [B, K-1, V] and a warped p [B, K, V] (a sort of the
           vocabulary at T > 0); `sparse` (the engine's default) keeps q where it is
           nonzero and builds p and q for one row (DSpine's candidates from the
           `--proposal-kernel` implementation of vocab_top_k);
  accept   step - draft - verify: cache bookkeeping, context extension, emission.
`--verify-width K ...` times the decode loop of each speculative method at each verify
width (the first K drafts checked per pass; 0 is a plain AR step inside the speculative
engine), the costs adaptive speculation chooses between; `speculation_projection.py` turns
them into tokens/s at a measured acceptance profile.
Drafters are freshly initialised (5 layers at the target's width, block 16): step times do
not depend on their weights, acceptance does, so the implied speedup is reported at
tau = 4, 6, 8 as tau * t_AR / t_step (against AR on the same backend and context). The
floor is the bytes a pass must read (target + drafter weights and both caches) over the
copy bandwidth measured in the same process.
--context N and --attention-backend work as in decode_step.py: the caches' lengths jump
to N after a --prompt-len prefill, and each backend is timed side by side; so is each
--layer-kernels value (xla, fused: the target's decode layers in four Pallas kernels).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import json
import os
import statistics
import time
from datetime import date

import jax
import numpy as np

from dspine_benchmarks.decode_step import (jax_copy_bandwidth, load_jax_target, median_time,
                                           step_bytes, with_context)


def add_step_args(p: argparse.ArgumentParser, *, sweep: bool,
                  methods: tuple[str, ...]) -> None:
    """The options of a run over prefilled random prompts and an engine (the target, the
    shapes, the drafter, the attention backend, the proposal path), shared with
    profile_step.py. `sweep`: --batch, --context, --attention-backend and --proposal take
    several values, each run in turn; else one value each."""
    from dspine_jax.drafters import DEFAULT_PROPOSAL, DEFAULT_PROPOSAL_KERNEL, PROPOSALS
    from dspine_jax.drafters.proposers import KERNEL_IMPLEMENTATIONS

    many = {"nargs": "+"} if sweep else {}

    def one_or_list(value):
        return [value] if sweep else value

    p.add_argument("--target", default="preset:smollm2-135m")
    p.add_argument("--methods", nargs="+", default=list(methods))
    p.add_argument("--batch", type=int, default=[1, 8, 32] if sweep else 1, **many)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--context", type=int, default=None, **many,
                   help="cache length(s) to time passes at (default: --prompt-len)")
    p.add_argument("--attention-backend", default=one_or_list("auto"),
                   choices=["auto", "pallas", "xla"], **many,
                   help="attention backend(s)" + (", timed side by side" if sweep else ""))
    p.add_argument("--layer-kernels", default=one_or_list("xla"), choices=["xla", "fused"],
                   **many, help="the target's decode layers: XLA's kernels, or fused "
                   "(pallas_kernels.decode_layer; CUDA GPUs)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--steps-per-call", type=int, default=8)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--proposal", default=one_or_list(DEFAULT_PROPOSAL), choices=list(PROPOSALS),
                   **many, help="proposal/verification path(s) of the speculative engine")
    p.add_argument("--proposal-kernel", default=DEFAULT_PROPOSAL_KERNEL,
                   choices=list(KERNEL_IMPLEMENTATIONS),
                   help="vocab_top_k implementation of DSpine's sparse proposal (pallas: "
                        "the platform's kernel, interpreted on the CPU)")
    p.add_argument("--temperature", type=float, default=one_or_list(0.0), **many,
                   help="sampling temperature" + ("(s)" if sweep else "") + "; 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p when temperature > 0")
    p.add_argument("--top-k", type=int, default=0, help="top-k when temperature > 0")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_step_args(p, sweep=True, methods=("ar", "dflash", "dspine"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-stages", action="store_true", help="skip the per-stage split")
    p.add_argument("--verify-width", type=int, nargs="+", default=None, metavar="K",
                   help="time each speculative method's step at each of these verify "
                        "widths (default: the whole block only)")
    p.add_argument("--compile-workers", type=int, default=min(16, os.cpu_count() or 1),
                   help="cells compiled at once before any is timed")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def make_decoder(method, model, config, args, backend, proposal="sparse", layers="xla"):
    from dspine_jax.drafters.config import DrafterConfig
    from dspine_jax.drafters.model import BlockDrafter
    from dspine_jax.engine import SpeculativeEngine
    from dspine_jax.generate import AutoregressiveGenerator

    options = dict(steps_per_call=args.steps_per_call, attention_backend=backend,
                   page_size=args.page_size, layer_kernels=layers)
    if method == "ar":
        return AutoregressiveGenerator(model, **options), 0
    dconfig = DrafterConfig.for_target(config, kind=method, num_layers=args.draft_layers,
                                       mask_token_id=1, block_size=args.block_size)
    drafter = BlockDrafter.create(dconfig, model.output_embedding(), dtype=model.dtype)
    drafter_params = sum(x.size for x in jax.tree.leaves(
        __import__("flax").nnx.state(drafter)))
    return SpeculativeEngine(model, drafter, proposal_impl=proposal,
                             proposal_kernel=args.proposal_kernel, **options), drafter_params


def sampling_options(args, temperature) -> dict:
    if temperature == 0:
        return {"temperature": 0.0}
    return {"temperature": temperature, "top_p": args.top_p, "top_k": args.top_k}


def stage_times(decoder, run, b, context, args, temperature=0.0, iterations: int = 16) -> dict:
    """Draft and verify alone, each repeated inside one compiled loop (so dispatch is
    amortised as in the decode loop), each iteration fed by the previous one's output
    so nothing can be hoisted out of the loop. The state (its caches) is carried through
    the loop and donated, as in the decode loop: the block's keys are written in place,
    never into a copy of the page pools."""
    from dspine_jax.sampling import SamplingParams

    params = decoder.params()
    sampling = SamplingParams.create(b, **sampling_options(args, temperature))
    key = jax.random.key(0)

    @functools.partial(jax.jit, donate_argnames=("state",))
    def drafts(params, state):
        def body(_, state):
            proposal, state = decoder.draft(params, state, sampling, key)
            return state.replace(last_token=proposal.tokens[:, 0])
        return jax.lax.fori_loop(0, iterations, body, state)

    @functools.partial(jax.jit, donate_argnames=("state",))
    def verifies(params, state, proposal):
        def body(_, carry):
            tokens, state = carry
            verdict, out = decoder.verify(params, state, proposal.replace(tokens=tokens),
                                          sampling, key)
            cache = out.cache.replace(lengths=state.caches[0].lengths)   # no step advances
            return (tokens.at[:, 0].set(verdict.next_token),
                    state.replace(caches=(cache,) + state.caches[1:]))
        return jax.lax.fori_loop(0, iterations, body, (proposal.tokens, state))[1]

    state = with_context(run.prefill(), context)
    proposal, state = jax.jit(lambda params, state: decoder.draft(params, state, sampling, key),
                              donate_argnames=("state",))(params, state)
    holder = {"state": state}

    def timed(loop, *extra):
        def call():
            holder["state"] = jax.block_until_ready(loop(params, holder["state"], *extra))
        return call

    times = {"draft_ms": timed(drafts), "verify_ms": timed(verifies, proposal)}
    return {k: median_time(fn, args.repeats) / iterations * 1e3 for k, fn in times.items()}


def prepare_cell(method, b, context, backend, model, config, args, proposal="sparse",
                 temperature=0.0, layers="xla"):
    """The engine of one cell and its compiled prefill and decode call (no timing)."""
    from dspine_jax.runtime.fixed_batch import FixedBatch

    # Untrained drafters keep ~1 token per pass: 4 per pass of budget is ample, and keeps
    # the cache capacity (which dense attention reads in full) the same as AR's.
    new_tokens = context - args.prompt_len + 4 * (args.calls + 2) * args.steps_per_call
    decoder, drafter_params = make_decoder(method, model, config, args, backend,
                                           proposal, layers)
    prompts = np.random.default_rng(0).integers(0, config.vocab_size,
                                                size=(b, args.prompt_len)).tolist()
    run = FixedBatch(decoder, prompts, max_new_tokens=new_tokens, ignore_eos=True,
                     **sampling_options(args, temperature))
    for width in (args.verify_width or []) if method != "ar" else []:
        jax.block_until_ready(run.decode(run.prefill(), width))    # compiles that width
    return decoder, drafter_params, run


def bench(prepared, method, b, context, config, dtype, bandwidth, args, proposal,
          temperature, width=None) -> dict:
    """Time one cell that `prepare_cell` compiled (a speculative one at verify `width`,
    None: the whole block; another width compiles in the untimed first loop)."""
    from dspine_jax.runtime.config import RuntimeConfig

    decoder, drafter_params, run = prepared
    passes = args.calls * args.steps_per_call

    def loop():
        state = run.decode(with_context(run.prefill(), context), width)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for _ in range(args.calls):
            state = run.decode(state, width)
            jax.device_get(state.num_generated)
        return (time.perf_counter() - t0) / passes

    loop()
    step = statistics.median(loop() for _ in range(args.repeats))
    itemsize = np.dtype(dtype).itemsize
    floor_bytes = step_bytes(config, b, context + passes, itemsize) + drafter_params * itemsize
    row = dict(method=method, attention_backend=decoder.attention.name,
               layer_kernels=RuntimeConfig.of(decoder).layer_kernels,
               context=context,
               batch=b, steps_per_call=args.steps_per_call, step_ms=step * 1e3,
               floor_ms=floor_bytes / bandwidth * 1e3,
               proposal=proposal if method != "ar" else "-", temperature=temperature,
               top_p=args.top_p if temperature else 1.0, top_k=args.top_k if temperature else 0,
               proposal_kernel=args.proposal_kernel,
               # the DSPINE_* switches the decoder was built with: a row names its variant
               switches=decoder.switches.to_json())
    if method != "ar":
        row["verify_width"] = decoder.default_width() if width is None else width
    if method != "ar" and not args.no_stages and width in (None, decoder.default_width()):
        row.update(stage_times(decoder, run, b, context, args, temperature))
        row["accept_ms"] = row["step_ms"] - row["draft_ms"] - row["verify_ms"]
    return row


def cells(args, contexts) -> list[tuple]:
    """(backend, context, batch, temperature, layer kernels, method, proposal) in run
    order: AR first in each group, as the implied speedups divide by it."""
    out = []
    for backend, context, b, temperature, layers in itertools.product(
            args.attention_backend, contexts, args.batch, args.temperature,
            args.layer_kernels):
        for m in args.methods:
            for p in (["-"] if m == "ar" else args.proposal):
                out.append((backend, context, b, temperature, layers, m, p))
    return out


def main(argv=None):
    args = parse_args(argv)
    contexts = args.context or [args.prompt_len]
    positions = max(contexts) + 4 * (args.calls + 2) * args.steps_per_call + args.block_size
    model, config, dtype = load_jax_target(args.target, args.dtype, positions)
    bandwidth = jax_copy_bandwidth()
    todo = cells(args, contexts)
    # Compiling dominates a cell (several programs, tens of seconds each on a GPU host):
    # every cell compiles at once on a thread pool (XLA compiles without the GIL), and only
    # then are they timed one by one, since host-side dispatch is part of a step.
    with concurrent.futures.ThreadPoolExecutor(args.compile_workers) as pool:
        prepared = list(pool.map(
            lambda c: prepare_cell(c[5], c[2], c[1], c[0], model, config, args,
                                   "sparse" if c[6] == "-" else c[6], c[3], c[4]), todo))
    print(f"compiled {len(todo)} cells", flush=True)
    rows = []
    ar_ms = {}
    for (backend, context, b, temperature, layers, method, proposal), ready in zip(
            todo, prepared):
        group = (backend, context, b, temperature, layers)
        for width in ([None] if method == "ar" or not args.verify_width
                      else args.verify_width):
            row = bench(ready, method, b, context, config, dtype, bandwidth, args, proposal,
                        temperature, width)
            if method == "ar":
                ar_ms[group] = row["step_ms"]
            elif group in ar_ms and row["verify_width"] == args.block_size - 1:
                for tau in (4, 6, 8):
                    row[f"speedup_tau{tau}"] = tau * ar_ms[group] / row["step_ms"]
            row.update(target=args.target, prompt_len=args.prompt_len,
                       block_size=args.block_size, draft_layers=args.draft_layers,
                       bandwidth_GBps=bandwidth / 1e9, device=str(jax.devices()[0]),
                       date=str(date.today()))
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(f"\n{'method':8} {'path':6} {'k':>3} {'T':>4} {'attn':6} {'layers':6} "
          f"{'context':>7} {'B':>3} "
          f"{'step ms':>9} {'floor':>7} "
          f"{'draft':>7} {'verify':>7} {'accept':>7} {'x@tau4':>7} {'x@tau6':>7} {'x@tau8':>7}")
    for r in rows:
        f = lambda k: f"{r[k]:7.2f}" if k in r else "      -"  # noqa: E731
        print(f"{r['method']:8} {r['proposal']:6} {r.get('verify_width', '-'):>3} "
              f"{r['temperature']:4.2g} "
              f"{r['attention_backend']:6} {r['layer_kernels']:6} {r['context']:7d} "
              f"{r['batch']:3d} "
              f"{r['step_ms']:9.3f} {f('floor_ms')} "
              f"{f('draft_ms')} {f('verify_ms')} {f('accept_ms')} {f('speedup_tau4')} "
              f"{f('speedup_tau6')} {f('speedup_tau8')}")


if __name__ == "__main__":
    main()
