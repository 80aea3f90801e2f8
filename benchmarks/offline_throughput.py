"""Offline throughput: many prompts through B rows, static batches against continuous
batching (SGLang's `bench_offline_throughput` shape), AR and every drafter, side by side,
both on the one engine (`dspine_jax.runtime`).

    python -m dspine_benchmarks.offline_throughput \
        --drafter smollm2-135m-instruct-dflash --drafter smollm2-135m-instruct-dspine \
        --prompts prompts.jsonl --num-prompts 64 --rows 8 --max-new-tokens 256 \
        --temperature 0 1 --out offline_throughput.json

For each method, temperature and row count B, the same prompts decode with
  batch   static batches: groups of B prompts, each a run of its own until its row with
          the most target passes is done (a speculative row advances by its own accepted
          length per pass, so the slowest row sets the batch's passes);
  slots   one run of B slots over every prompt (`dspine generate --batch-size B`), a
          finished row's slot taking the next prompt at once.
Every row decodes exactly --max-new-tokens (EOS ignored), so every method emits the same
tokens. Each (method, engine, T, B) decodes all prompts once untimed (which compiles
its programs and pays XLA's one-time setup of each), then
--repeats timed runs (the median; `seconds_runs` lists each); tokens/s = all new tokens /
decode seconds, compilation excluded. x_ar is tokens/s over AR's with the same engine,
passes per call, T and B; x_ar_best over AR's best engine. --slot-steps-per-call runs the
slots at each of several call lengths.
row_passes: the target passes of every row, summed (tokens per row pass: tau).
`batch` rows also give batch_passes (each batch decodes until its row with the most
passes is done, summed over batches), row_pass_share = row_passes / (batch_passes x B)
(the straggler cost), ms_per_pass = seconds / batch_passes, prefill included, and
`loop_vs_engine`'s prefill_seconds, pass_ms (prefill excluded) and first_run_seconds; `slots`
rows give the engine's steps (each: a prefill and/or a decode call of several passes) and
compile_seconds (the untimed run's). verify_widths (every row, either engine; AR: width 0):
the target passes at each verify width of the median run, what adaptive speculation
picked.
same_as_ar (T = 0, when AR ran): the share of prompts whose tokens equal AR's from its
first engine (batch, unless --engine slots alone) at the same B; lossless decoding gives
1 in exact float32, and in bf16 AR's own slots row is the baseline (near-ties flip a few
rows between any two call shapes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from dspine_benchmarks.loop_vs_engine import batches, passes_by_width, read_prompts, time_engine
from dspine_jax.speculative.policy import MODES, SpeculationConfig, slot_acceptance

ENGINES = ("batch", "slots")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target (default: the built-in one)")
    ap.add_argument("--drafter", action="append", default=[], help="repeatable")
    ap.add_argument("--prompts", required=True, help="JSONL prompts (as for `dspine generate "
                                                     "--prompts-file`)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--rows", type=int, nargs="+", default=[8],
                    help="rows of a static batch, and slots (B)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    ap.add_argument("--engine", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "pallas", "xla"])
    ap.add_argument("--proposal-kernel", default="auto", choices=["auto", "pallas", "xla"])
    ap.add_argument("--speculation", nargs="+", choices=MODES, default=["adaptive"],
                    help="drafters' verify widths, each mode a row of its own")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed runs of each static-batch cell after an untimed one (median)")
    ap.add_argument("--slot-steps-per-call", type=int, nargs="+", default=None,
                    help="target passes per decode call of the slots (several: a row each; "
                         "default: the serving engine's)")
    ap.add_argument("--seed", type=int, default=None,
                    help="slots: prompt i samples from S + i, and a drafter verifies its "
                         "whole block at T > 0 (default: fresh seeds, adaptive widths); "
                         "static batches always seed batch g from g x B")
    ap.add_argument("--skip-ar", action="store_true")
    ap.add_argument("--out", default=None, help="JSON, rewritten after every row")
    args = ap.parse_args(argv)
    if min(args.num_prompts, args.max_new_tokens, min(args.rows), args.repeats) < 1:
        ap.error("--num-prompts, --max-new-tokens, --rows and --repeats must be positive")
    return args


def run_batch(pipe, prompts, rows, kw, drafter, repeats) -> dict:
    """Static batches of `rows`: the median of `repeats` timed runs after an untimed one
    (`loop_vs_engine`'s). A drafter verifying its whole block on every pass also gives
    its per-slot acceptance profile (what adaptive speculation's choice depends on)."""
    groups = batches(prompts, rows)
    tokens, accepts, seconds, fields = time_engine(pipe, groups, rows, drafter, kw, repeats)
    # a row's passes after the prefill, which emits its first token (AR: one per token)
    own = sum(len(a) for a in accepts) if drafter else sum(len(t) - 1 for t in tokens)
    widest = drafter and pipe.decoder.default_width()
    if drafter and set(fields.get("verify_widths", {})) == {str(widest)}:
        kept = [a - 1 for row in accepts for a in row]
        fields["acceptance_profile"] = [round(a, 4) for a in slot_acceptance(kept, widest)]
    return {"tokens": sum(len(t) for t in tokens), "seconds": seconds, "row_passes": own,
            **fields, "ms_per_pass": round(1e3 * seconds / fields["batch_passes"], 3)}, tokens


def run_slots(pipe, prompts, rows, kw, repeats, seed=None) -> dict:
    """`rows` slots over every prompt: the median of `repeats` timed runs after an untimed
    one (which compiles); prompt i samples from seed + i, or from a fresh seed."""
    from dspine_jax.runtime.offline import generate_tokens

    kw = dict(kw, seed=seed)

    compiled = generate_tokens(pipe.decoder, prompts, max_slots=rows, **kw).compile_seconds
    runs = [generate_tokens(pipe.decoder, prompts, max_slots=rows, **kw)
            for _ in range(repeats)]
    run = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
    widths = passes_by_width(run.generations)
    return {"tokens": sum(len(g.tokens) for g in run.generations), "seconds": run.seconds,
            "seconds_runs": [round(r.seconds, 4) for r in runs],
            "row_passes": sum(len(g.accept_lengths) for g in run.generations),
            "steps": run.steps,
            "preemptions": run.preemptions, "compile_seconds": round(compiled, 1),
            **({"verify_widths": widths} if widths else {})}, [
        g.tokens for g in run.generations]


def main(argv=None):
    args = parse(argv)
    sys.stdout.reconfigure(line_buffering=True)
    import jax

    from dspine_jax.api import Pipeline
    from dspine_jax.checkpoints import load_target
    from dspine_jax.registry import DEFAULT_TARGET, resolve_drafter

    texts = read_prompts(args.prompts, args.num_prompts)
    methods = ([] if args.skip_ar else [("ar", None, None)]) + [
        (Path(str(resolve_drafter(d))).name, d, mode) for d in args.drafter
        for mode in args.speculation]
    loaded = load_target(args.target or DEFAULT_TARGET, dtype=args.dtype)
    meta = {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
            "device": str(jax.devices()[0].device_kind), "dtype": args.dtype,
            "target": str(args.target or DEFAULT_TARGET), "prompts": args.prompts,
            "num_prompts": len(texts), "max_new_tokens": args.max_new_tokens,
            "attention_backend": args.attention_backend,
            "proposal_kernel": args.proposal_kernel}
    rows = []
    greedy_ar = {}      # rows -> AR's T = 0 tokens from its first engine (the reference)
    for method, drafter, mode in methods:
        # every engine with the offline call length (the slots: or each
        # --slot-steps-per-call)
        variants = [(e, n) for e in args.engine
                    for n in ((args.slot_steps_per_call or [None]) if e == "slots" else [None])]
        pipes = {(engine, n): Pipeline.from_loaded(
            loaded, drafter, method=None if drafter else "ar", steps_per_call=n,
            attention_backend=args.attention_backend,
            **({"proposal_kernel": args.proposal_kernel,
                "speculation": SpeculationConfig(mode)} if drafter else {}))
            for engine, n in variants}
        prompts = [pipes[variants[0]].encode(p) for p in texts]
        for t in args.temperature:
            kw = dict(max_new_tokens=args.max_new_tokens, temperature=t, ignore_eos=True)
            for b in args.rows:
                for engine, n in variants:
                    pipe = pipes[(engine, n)]
                    got, tokens = (
                        run_batch(pipe, prompts, b, kw, drafter, args.repeats)
                        if engine == "batch" else run_slots(pipe, prompts, b, kw,
                                                            args.repeats, args.seed))
                    got["steps_per_call"] = pipe.decoder.steps_per_call
                    if t == 0 and method == "ar" and b not in greedy_ar:
                        greedy_ar[b] = tokens
                    if t == 0 and b in greedy_ar:
                        # lossless at T = 0 means AR's tokens; bf16 near-ties flip some
                        # rows even between AR's own two engines (the baseline)
                        same = [x == y for x, y in zip(tokens, greedy_ar[b])]
                        got["same_as_ar"] = round(sum(same) / len(same), 4)
                    # a pass emits its accepted tokens; the prefill emits each row's first
                    row = {"method": method, "speculation": mode, "engine": engine,
                           "temperature": t, "rows": b,
                           **got, "seconds": round(got["seconds"], 4),
                           "tokens_per_s": round(got["tokens"] / got["seconds"], 1),
                           "tau": round((got["tokens"] - len(prompts)) / got["row_passes"], 3)}
                    rows.append(row)
                    add_ratios(rows)
                    print(json.dumps(row))
                    if args.out:
                        Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print(table(rows))


def add_ratios(rows) -> None:
    """x_ar: tokens/s over AR's at the same engine, T and rows; x_ar_best: over AR's best
    engine there."""
    ar = {(r["engine"], r.get("steps_per_call"), r["temperature"], r["rows"]):
          r["tokens_per_s"] for r in rows if r["method"] == "ar"}
    for r in rows:
        same = ar.get((r["engine"], r.get("steps_per_call"), r["temperature"], r["rows"]))
        best = max((v for (e, n, t, b), v in ar.items()
                    if (t, b) == (r["temperature"], r["rows"])), default=None)
        if same:
            r["x_ar"] = round(r["tokens_per_s"] / same, 3)
        if best:
            r["x_ar_best"] = round(r["tokens_per_s"] / best, 3)


def table(rows) -> str:
    head = ("| method | T | rows | engine | passes per call | tok/s | x AR | x best AR | tau "
            "| row pass share | ms per pass | same as AR |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        method = r["method"] + (f" ({r['speculation']})" if r.get("speculation") else "")
        lines.append(f"| {method} | {r['temperature']:g} | {r['rows']} | {r['engine']} | "
                     f"{r.get('steps_per_call', '')} | "
                     f"{r['tokens_per_s']:,.0f} | {r.get('x_ar', '')} | "
                     f"{r.get('x_ar_best', '')} | {r['tau']} | {r.get('row_pass_share', 1)} | "
                     f"{r.get('ms_per_pass', '')} | {r.get('same_as_ar', '')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
