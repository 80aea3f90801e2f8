"""The median of repeated `dspine bench serve` runs, per server and concurrency level, side
by side, with each server's x over the first one (the AR server).

    for r in 1 2 3 4 5; do
        dspine bench serve --base-url URL --concurrency 1 8 32 64 --out runs/ar/run$r ...
    done
    python -m dspine_benchmarks.serving_summary runs/ar runs/dspine --out summary.json

Each folder holds one server's runs (any results.json below it; a level may come from
several invocations, e.g. concurrency 1 with fewer prompts). Per level: the median output
tokens/s over the runs (with the min and max), and the medians of TTFT p50, ITL p50,
tau and the shares of the level's time the server's device spent decoding, prefilling
and idle between calls queued back to back (waiting for the host); failures are summed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path


def collect(folder: Path) -> dict[int, list[dict]]:
    """concurrency -> that level's result from every run under `folder`."""
    levels: dict[int, list[dict]] = {}
    for path in sorted(folder.rglob("results.json")):
        for level in json.loads(path.read_text())["levels"]:
            levels.setdefault(level["concurrency"], []).append(level)
    if not levels:
        raise SystemExit(f"{folder}: no results.json below it")
    return levels


def summarise(levels: dict[int, list[dict]]) -> dict[int, dict]:
    out = {}
    for c, runs in sorted(levels.items()):
        tps = [r["output_throughput"] for r in runs]
        out[c] = {"runs": len(runs), "output_tokens_per_s": statistics.median(tps),
                  "min": min(tps), "max": max(tps),
                  "completed": sum(r["completed"] for r in runs),
                  "failed": sum(r["failed"] for r in runs),
                  "ttft_p50_ms": _median(r["median_ttft_ms"] for r in runs),
                  "itl_p50_ms": _median(r["median_itl_ms"] for r in runs),
                  # a run of one wave (prompts = concurrency) lasts as long as its slowest
                  # request: the mean request time shows what a longer run would give
                  "e2e_mean_ms": _median(r["mean_e2e_latency_ms"] for r in runs),
                  "tau": _median(r["accept_length"] for r in runs),
                  # the server's device over the level: busy (prefill + decode) and idle
                  # between calls queued back to back (waiting for the host), as shares
                  # of the level's time (nan: a server without the counters)
                  **{f"device_{c}_share": _median(r.get(f"device_{c}_share", math.nan)
                                                  for r in runs)
                     for c in ("prefill", "decode", "idle")}}
    return out


def _median(values) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def _percent(share: float) -> str:
    return "-" if math.isnan(share) else f"{100 * share:.0f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", type=Path, nargs="+", help="one per server; the first is the "
                    "baseline of the x column")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    table = {f.name: summarise(collect(f)) for f in args.folders}
    base = table[args.folders[0].name]
    print("| server | concurrency | runs | ok | output tok/s median (min-max) | x first "
          "| TTFT p50 ms | ITL p50 ms | request mean ms | tau | device % decode / prefill "
          "/ idle |")
    print("|" + "---|" * 11)
    for name, levels in table.items():
        for c, s in levels.items():
            ref = base.get(c, {}).get("output_tokens_per_s")
            s["x_first"] = round(s["output_tokens_per_s"] / ref, 3) if ref else None
            device = " / ".join(_percent(s[f"device_{k}_share"])
                                for k in ("decode", "prefill", "idle"))
            print(f"| {name} | {c} | {s['runs']} | {s['completed']}/{s['completed'] + s['failed']}"
                  f" | {s['output_tokens_per_s']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f}) | "
                  f"{s['x_first'] or '-'} | {s['ttft_p50_ms']:.0f} | {s['itl_p50_ms']:.1f} | "
                  f"{s['e2e_mean_ms']:.0f} | {s['tau']:.2f} | "
                  f"{device} |")
    if args.out:
        args.out.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
