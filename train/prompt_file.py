"""A portable prompts file for `dspine data regenerate --source FILE.jsonl`: ShareGPT's
training turns, each already cut to fit the prompt budget, first turns first.

    python -m dspine_train.prompt_file --out prompts.jsonl --max-prompt-tokens 256

A FILE.jsonl.gz out is gzipped for carrying to the host (gunzip it there: regeneration
reads plain JSONL).

The file carries only what regeneration reads (one {"id", "messages"} line per prompt,
earlier turns dropped by whole turns as `fit_chat` drops them), so a GPU host without the
125 MB ShareGPT package regenerates from it the same data it would from the package.
Order: every first human turn in ShareGPT's order (the set the shipped drafters were
trained on), then every later turn, shuffled with --seed. A regeneration stopped by
--max-seconds has then covered the first turns before any later one. Prompts that cannot
fit (their last user turn alone is longer than the budget) are left out and counted.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np

from dspine_jax.data.prompts import fit_chat, sharegpt_prompts


def ordered_prompts(seed: int, path: Path | None = None) -> list[dict]:
    """First turns in ShareGPT's order, then later turns (with context) shuffled. A
    conversation that opens with an assistant turn has its first human turn in both
    lists (alone, and after that turn): it is kept once, as a first turn."""
    first = sharegpt_prompts("train", path=path, turns="first")
    seen = {(p["id"], p["prompt"]) for p in first}
    later = [p for p in sharegpt_prompts("train", path=path, turns="all")
             if len(p["messages"]) > 1 and (p["id"].rpartition("#")[0], p["prompt"]) not in seen]
    order = np.random.default_rng(seed).permutation(len(later))
    return first + [later[i] for i in order]


def fitted_lines(tokenizer, prompts: list[dict], max_tokens: int) -> tuple[list[str], int]:
    """(JSONL lines of the prompts that fit, number left out)."""
    lines, skipped = [], 0
    for p in prompts:
        fitted = fit_chat(tokenizer, p["messages"], max_tokens)
        if fitted is None:
            skipped += 1
            continue
        _, dropped = fitted
        # ASCII escapes: no line separator inside a string (U+2028 is one to splitlines)
        lines.append(json.dumps({"id": p["id"], "messages": p["messages"][dropped:]}))
    return lines, skipped


def main(argv=None) -> None:
    from dspine_jax.checkpoints import load_target

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="FILE.jsonl or FILE.jsonl.gz")
    ap.add_argument("--target", default="smollm2-135m-instruct",
                    help="whose tokenizer and chat template measure the prompts")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.out.exists():
        ap.error(f"{args.out} exists; choose another --out")
    if args.max_prompt_tokens < 1:
        ap.error("--max-prompt-tokens must be positive")

    tokenizer = load_target(args.target, with_tokenizer=True).tokenizer
    prompts = ordered_prompts(args.seed)
    lines, skipped = fitted_lines(tokenizer, prompts, args.max_prompt_tokens)
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.suffix == ".gz":
        with gzip.open(args.out, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        args.out.write_text(text, encoding="utf-8")
    first = sum(1 for p in prompts if len(p["messages"]) == 1)
    print(f"{args.out}: {len(lines)} prompts ({first} first turns before the later ones), "
          f"{skipped} left out as longer than {args.max_prompt_tokens} tokens")


if __name__ == "__main__":
    main()
