"""One curve for a chain of training runs: their metrics.csv joined on a global step.

    python -m dspine_train.chain RUN_DIR [RUN_DIR ...] --out DIR

The runs are given in chain order. Each folder's chain.json (written by `dspine train` on
its first start) says how it began: a link that resumed another run (`--resume-from`)
already counts steps globally; a link started from weights alone (`--init-from`) or from
scratch counts from 0, so its steps are shifted to follow the previous link's last step.
A step logged twice (a link killed after logging past its last checkpoint, then resumed)
keeps its later row. Writes DIR/chain.csv (column `run`: the folder each row came from)
and DIR/chain.png (loss, acceptance, accuracy; dotted lines where links start).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from dspine_jax.errors import InputError
from dspine_train.metrics import plot_rows


def read_run(folder: Path) -> tuple[dict, list[dict]]:
    folder = Path(folder)
    path = folder / "metrics.csv"
    if not path.is_file():
        raise InputError(f"{folder}: no metrics.csv (not a training run folder)")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    start = folder / "chain.json"
    origin = json.loads(start.read_text()) if start.is_file() else {"start": "scratch",
                                                                     "start_step": 0}
    return origin, rows


def join(folders: list[Path]) -> tuple[list[dict], list[int]]:
    """(rows ordered by global step, the global step at which each link starts)."""
    joined: dict[int, dict] = {}
    boundaries, last = [], 0
    for folder in folders:
        origin, rows = read_run(folder)
        resumed = origin.get("start") == "resume"
        offset = 0 if resumed else last
        begin = int(origin.get("start_step", 0)) + offset
        # A resumed link replaces whatever the previous links logged after its start.
        joined = {s: r for s, r in joined.items() if s <= begin}
        for row in rows:
            step = int(row["step"]) + offset
            joined[step] = {**row, "step": step, "run": str(folder)}
        boundaries.append(begin)
        last = max(joined) if joined else begin
    return [joined[s] for s in sorted(joined)], boundaries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders, in chain order")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows, boundaries = join(args.runs)
    args.out.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(args.out / "chain.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    plot_rows(rows, args.out / "chain.png", boundaries[1:],
              title=f"{len(args.runs)} runs, {rows[-1]['step'] if rows else 0} steps")
    print(f"{args.out / 'chain.csv'}: {len(rows)} rows from {len(args.runs)} runs; "
          f"links start at steps {boundaries}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
