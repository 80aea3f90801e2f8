"""`dspine serve` over a device that only waits (`simulated_device`): the real app, engine
loop, engine core, scheduler and adaptive policy, the AR and the drafter server side by
side, streamed to `dspine bench serve`'s client in another process. Given a device's
measured costs, it says what the rest of the server makes of them: if the simulated
servers reproduce a real run's ratio, what limits that run is in the host path or the
order of calls, and it can be worked on without the accelerator.

    python -m dspine_benchmarks.serve_simulated --concurrency 64 --repeats 5 \\
        --step-ms 1:1.0,16:1.365,32:1.463,64:1.733 \\
        --pass-ms 1:1.7,16:2.538,32:2.782,64:4.79 --prefill-ms 1 1 --alpha 0.73 --out sim.json

--step-ms and --pass-ms: a plain step's and a whole-block pass's device time by rows
(rows:ms pairs, linear between); --prefill-ms BASE PER_1K: a prefill call's time, fixed
plus per 1,000 padded tokens; --alpha: the chance each next draft is accepted (one value,
or one per draft slot). `dspine` verifies at any of adaptive speculation's widths (0, 1,
3, 7, 15), `dspine-ends` at 0 or 15 only. Passes per call are the serving defaults (AR
8, drafters 4, 16 alone). Prompts are the bench client's (held-out ShareGPT by default),
tokenized by the built-in target's tokenizer; the "device" emits ordinary text.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from dspine_benchmarks import serve_host_path
from dspine_benchmarks.simulated_device import DeviceCosts, SimulatedDecoder, parse_curve

# dspine-ends: adaptive speculation choosing only between a plain step and the whole block
METHODS = ("ar", "dspine", "dspine-ends")


def build_core(args, method: str, vocab: list[int], seed: int):
    from dspine_jax.api import steps_per_call_for
    from dspine_jax.runtime.engine_core import EngineConfig, EngineCore
    from dspine_jax.speculative.policy import SpeculationConfig

    costs = DeviceCosts(parse_curve(args.step_ms), parse_curve(args.pass_ms),
                        tuple(args.prefill_ms))
    alone, shared = steps_per_call_for(method, serving=True)
    decoder = SimulatedDecoder(costs, num_slots=args.max_slots, vocabulary=vocab,
                               alpha=None if method == "ar" else args.alpha,
                               steps_per_call=alone, shared_steps_per_call=shared,
                               speculation=SpeculationConfig(args.speculation), seed=seed)
    widths = (0, costs.block_size - 1) if method == "dspine-ends" else None
    core = EngineCore(decoder, EngineConfig(max_slots=args.max_slots,
                                            max_model_len=args.max_model_len,
                                            verify_widths=widths))
    core.warmup()
    return core


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["ar", "dspine"], choices=METHODS)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64])
    ap.add_argument("--max-slots", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--step-ms", default="1:1.0,16:1.365,32:1.463,64:1.733")
    ap.add_argument("--pass-ms", default="1:1.7,16:2.538,32:2.782,64:4.79")
    ap.add_argument("--prefill-ms", type=float, nargs=2, default=[1.0, 1.0],
                    metavar=("BASE", "PER_1K"))
    ap.add_argument("--alpha", type=float, nargs="+", default=[0.73])
    ap.add_argument("--speculation", default="adaptive", choices=["adaptive", "fixed"])
    ap.add_argument("--prompts", default="sharegpt:heldout")
    ap.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"])
    ap.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--work", default="runs/serve-simulated")
    ap.add_argument("--out", default=None, help="JSON of every run and the medians")
    args = ap.parse_args(argv)
    if min(min(args.concurrency), args.max_slots, args.num_prompts, args.max_tokens,
           args.repeats) < 1:
        ap.error("counts must be >= 1")
    if not all(0 <= a < 1 for a in args.alpha):
        ap.error("--alpha values must be in [0, 1)")
    try:
        parse_curve(args.step_ms), parse_curve(args.pass_ms)
    except ValueError as e:
        ap.error(str(e))
    from dspine_benchmarks.train_scaling import free_port

    tokenizer, vocab = serve_host_path.builtin_text()
    runs: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):     # the methods alternate: drift hits both alike
        for concurrency in args.concurrency:
            for method in args.methods:
                level = argparse.Namespace(**{**vars(args), "concurrency": concurrency})
                core = build_core(args, method, vocab, seed=repeat)
                run = serve_host_path.serve_once(level, tokenizer, vocab, free_port(),
                                                 core=core, method=method.split("-")[0])
                runs.setdefault(f"{method}@{concurrency}", []).append(run)
                print(f"{method} c{concurrency} run {repeat + 1}: "
                      f"{run['output_throughput']:,.0f} tok/s", file=sys.stderr)
    medians = {k: statistics.median(r["output_throughput"] for r in v)
               for k, v in runs.items()}
    report = {"args": {k: v for k, v in vars(args).items() if k not in ("out", "work")},
              "runs": runs, "median_tokens_per_s": medians}
    if "ar" in args.methods:
        report["over_ar"] = {m: {c: round(medians[f"{m}@{c}"] / medians[f"ar@{c}"], 3)
                                 for c in args.concurrency}
                             for m in args.methods if m != "ar"}
    return serve_host_path.write_report(report, args.out)


if __name__ == "__main__":
    main()
