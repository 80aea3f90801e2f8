"""Projected tokens/s of adaptive speculation against fixed-width speculation and AR, from
pass times measured per verify width (`spec_step.py --verify-width`, e.g. at Qwen3-8B's
shapes with random weights) and a per-slot acceptance profile measured with a trained
drafter (`offline_throughput.py`'s `acceptance_profile`, from passes that verified the
whole block).

    python -m dspine_benchmarks.spec_step --target preset:qwen3-8b --batch 1 8 32 \\
        --methods ar dspine --verify-width 0 1 3 7 15 --no-stages --out steps.jsonl
    python -m dspine_benchmarks.speculation_projection --steps steps.jsonl \\
        --profile offline_throughput.json --out projection.json

For each (method, batch B): a width k's tokens/s is B * E_k / c(B, k), with
E_k = 1 + sum_{j <= k} prod_{i <= j} alpha_i the expected tokens of a pass and c its
measured time; the adaptive width is the one `SpeculationPolicy.pick` takes (the widest
within its tolerance of the best), the fixed width the whole block.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspine_jax.speculative.policy import SpeculationConfig, SpeculationPolicy, expected_tokens


def read_profile(path: Path, method: str | None = None) -> list[float]:
    """The acceptance profile of an offline_throughput JSON (its first row that has one,
    of `method` if given: a drafter's folder name) or a JSON list of rates."""
    data = json.loads(path.read_text())
    if isinstance(data, list):
        return [float(a) for a in data]
    for row in data["rows"]:
        if "acceptance_profile" in row and (method is None or row["method"] == method):
            return row["acceptance_profile"]
    raise SystemExit(f"{path}: no row with an acceptance_profile"
                     + (f" for {method}" if method else ""))


def project(steps: list[dict], alpha: list[float]) -> list[dict]:
    """One row per (method, batch): tokens/s per width, the adaptive and fixed widths'."""
    ar = {r["batch"]: r["step_ms"] for r in steps if r["method"] == "ar"}
    cells: dict[tuple[str, int], dict[int, float]] = {}
    for r in steps:
        if r["method"] != "ar":
            cells.setdefault((r["method"], r["batch"]), {})[r["verify_width"]] = r["step_ms"]
    out = []
    for (method, b), ms in sorted(cells.items()):
        widest = max(ms)
        policy = SpeculationPolicy(SpeculationConfig("adaptive", widest), widest + 1)
        rates = {k: b * expected_tokens(alpha, k) / (c / 1e3) for k, c in sorted(ms.items())}
        pick = policy.pick(rates)
        row = {"method": method, "batch": b, "ms_per_pass": ms,
               "expected_tokens": {k: round(expected_tokens(alpha, k), 3) for k in ms},
               "tokens_per_s": {k: round(v, 1) for k, v in rates.items()},
               "adaptive_width": pick, "fixed_width": widest,
               "x_fixed": round(rates[pick] / rates[widest], 3)}
        if b in ar:
            row["ar_tokens_per_s"] = round(b / (ar[b] / 1e3), 1)
            row["x_ar_adaptive"] = round(rates[pick] / row["ar_tokens_per_s"], 3)
            row["x_ar_fixed"] = round(rates[widest] / row["ar_tokens_per_s"], 3)
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    lines = ["| method | B | AR tok/s | fixed (k=15) tok/s (x AR) | adaptive k | "
             "adaptive tok/s (x AR) | x fixed |", "|" + "---|" * 7]
    for r in rows:
        fixed, pick = r["fixed_width"], r["adaptive_width"]
        ar = r.get("ar_tokens_per_s")
        lines.append(
            f"| {r['method']} | {r['batch']} | {ar or '-':,} | "
            f"{r['tokens_per_s'][fixed]:,.0f} ({r.get('x_ar_fixed', '-')}x) | {pick} | "
            f"{r['tokens_per_s'][pick]:,.0f} ({r.get('x_ar_adaptive', '-')}x) | "
            f"{r['x_fixed']} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=Path, required=True, help="spec_step.py's JSONL")
    ap.add_argument("--profile", type=Path, required=True,
                    help="offline_throughput.py's JSON, or a JSON list of per-slot rates")
    ap.add_argument("--profile-method", default=None,
                    help="the drafter row to take the profile from (default: the first)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    steps = [json.loads(line) for line in args.steps.read_text().splitlines() if line.strip()]
    alpha = read_profile(args.profile, args.profile_method)
    rows = project(steps, alpha)
    if not rows:
        raise SystemExit(f"{args.steps}: no speculative rows with a verify_width")
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps({"acceptance_profile": alpha, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
