"""AR against a drafter under each speculation mode, side by side in one process: the same
prompt decoded `--repeats` times per method, the methods interleaved, so every row sees
the same machine state.

    python -m dspine_benchmarks.speculation_modes --drafter smollm2-135m-instruct-dspine \
        --modes fixed adaptive off --repeats 6 --max-new-tokens 128 --out modes.json

The first decode of each method also loads its programs and, under `adaptive`, is where
the policy measures the costs it has not yet saved (a fresh cache folder: the cold
start); it is reported apart (`first_run_tok_s`), the other runs give the median and the
min-max. Each run's tokens are compared with AR's (T = 0: they must be equal) and its
verify widths (passes per width) are kept. Set DSPINE_CACHE_DIR to an empty folder for a
cold start.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

from dspine_jax.speculative.policy import MODES

DEFAULT_PROMPT = "Explain speculative decoding in one paragraph."


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target (default: the built-in one)")
    ap.add_argument("--drafter", default=None,
                    help="drafter (default: the built-in target's DSpine drafter)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--no-chat", action="store_true", help="the prompt without the template")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=["fixed", "adaptive"])
    ap.add_argument("--repeats", type=int, default=6, help="decodes per method (>= 2)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "auto"])
    ap.add_argument("--out", type=Path, default=None, help="JSON of every run")
    args = ap.parse_args(argv)
    if args.repeats < 2:
        ap.error("--repeats must be at least 2 (the first run is reported apart)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax

    from dspine_benchmarks.loop_vs_engine import passes_by_width
    from dspine_jax.api import Pipeline
    from dspine_jax.checkpoints import load_target
    from dspine_jax.registry import DEFAULT_TARGET
    from dspine_jax.speculative.policy import SpeculationConfig

    target = args.target or DEFAULT_TARGET
    drafter = args.drafter or f"{target}-dspine"
    loaded = load_target(target, dtype=args.dtype)
    pipes = {"ar": Pipeline.from_loaded(loaded)}
    for mode in args.modes:
        pipes[mode] = Pipeline.from_loaded(loaded, drafter,
                                           speculation=SpeculationConfig(mode))
    runs: dict[str, list[dict]] = {name: [] for name in pipes}
    reference = None
    for _ in range(args.repeats):
        for name, pipe in pipes.items():
            r = pipe.generate([args.prompt], chat=not args.no_chat,
                              max_new_tokens=args.max_new_tokens)[0]
            if name == "ar":
                reference = r.tokens
            runs[name].append({"tokens_per_s": r.num_tokens / r.seconds,
                               "tokens": r.num_tokens, "same_as_ar": r.tokens == reference,
                               "tau": r.mean_accept_length,
                               "verify_widths": passes_by_width([r])})
    summary = {}
    for name, rows in runs.items():
        rates = [row["tokens_per_s"] for row in rows[1:]]
        summary[name] = {"median_tok_s": round(statistics.median(rates), 2),
                         "min_tok_s": round(min(rates), 2), "max_tok_s": round(max(rates), 2),
                         "first_run_tok_s": round(rows[0]["tokens_per_s"], 2),
                         "x_ar": round(statistics.median(rates)
                                       / statistics.median(r["tokens_per_s"]
                                                           for r in runs["ar"][1:]), 3),
                         "same_as_ar": all(row["same_as_ar"] for row in rows)}
        print(json.dumps({"method": name, **summary[name]}))
    report = {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
              "device": jax.devices()[0].device_kind, "target": target, "drafter": drafter,
              "prompt": args.prompt, "max_new_tokens": args.max_new_tokens,
              "dtype": args.dtype, "summary": summary, "runs": runs}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
