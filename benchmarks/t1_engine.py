"""Real acceptance at T > 0: the engine's mean tokens per verify pass for DFlash and for
DSpine with each decoding option of its config (`chain_temperature`, `marginal_tail`,
`top_k`), on the same held-out ShareGPT prompts and seed.

    python -m dspine_benchmarks.t1_engine --out DIR [--prompts 16] [--max-new-tokens 128]
        [--only NAME ...]

A variant is the shipped DSpine drafter with its config.json's DSpine fields changed (a
temporary folder whose weights are a link to the shipped ones). Writes t1_engine.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from dspine_benchmarks.drafter_diagnostics import add_heldout_args, heldout_prompts
from dspine_jax.api import Pipeline
from dspine_jax.checkpoints import load_target
from dspine_jax.registry import resolve_drafter
from dspine_jax.speculative.policy import SpeculationConfig

VARIANTS = {"dspine": {}, "dspine chain_temperature=1.5": {"chain_temperature": 1.5},
            "dspine marginal_tail": {"marginal_tail": True},
            "dspine marginal_tail chain_temperature=1.5": {"marginal_tail": True,
                                                           "chain_temperature": 1.5},
            "dspine top_k=64 chain_temperature=1.5": {"top_k": 64, "chain_temperature": 1.5},
            "dspine vocabulary_chain": {"vocabulary_chain": True},
            "dspine vocabulary_chain chain_temperature=1.25": {"vocabulary_chain": True,
                                                               "chain_temperature": 1.25}}
DECODING = ("chain_temperature", "marginal_tail", "vocabulary_chain")


def variant_folder(shipped: Path, fields: dict, folder: Path) -> Path:
    """The shipped drafter with `fields` of its DSpine config changed."""
    raw = json.loads((shipped / "config.json").read_text())
    for key, value in fields.items():
        section = "dspine_jax_decoding" if key in DECODING else "dspine_config"
        raw.setdefault(section, {})[key] = value
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    link = folder / "model.safetensors"
    if not link.exists():
        link.symlink_to((shipped / "model.safetensors").resolve())
    return folder


def accept_stats(results) -> dict:
    """Tokens per verify pass over every pass of every prompt (the last pass of a prompt may
    be cut by the budget: counted as it is, for every drafter alike)."""
    lens = np.concatenate([np.asarray(r.accept_lengths, np.float64) for r in results])
    per_prompt = [float(np.mean(r.accept_lengths)) for r in results if r.accept_lengths]
    return {"passes": int(len(lens)), "tau": float(lens.mean()),
            "tau_se": float(lens.std(ddof=1) / np.sqrt(len(lens))),
            "tokens": int(sum(len(r.tokens) for r in results)), "per_prompt": per_prompt}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_heldout_args(parser)
    parser.add_argument("--dflash", default="smollm2-135m-instruct-dflash")
    parser.add_argument("--dspine", default="smollm2-135m-instruct-dspine")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--only", action="append", help="run only these variant names")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    loaded = load_target(args.target)
    ar = Pipeline.from_loaded(loaded)
    prompts = heldout_prompts(ar, args.prompts, args.max_prompt_tokens)
    shipped = resolve_drafter(args.dspine)
    folders = {"dflash": resolve_drafter(args.dflash)}
    tmp = Path(tempfile.mkdtemp(prefix="t1_engine_"))
    folders |= {name: variant_folder(shipped, fields, tmp / name.replace(" ", "_"))
                for name, fields in VARIANTS.items()}
    report = {"settings": vars(args) | {"out": str(args.out)}, "variants": VARIANTS}
    for name, folder in folders.items():
        if args.only and name not in args.only:
            continue
        start = time.time()
        pipe = Pipeline.from_loaded(loaded, folder, speculation=SpeculationConfig("fixed"))
        results = pipe.generate(prompts, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, seed=args.seed,
                                batch_size=args.batch_size)
        report[name] = accept_stats(results) | {"seconds": time.time() - start}
        print(f"{name:45s} tau {report[name]['tau']:.3f} +- {report[name]['tau_se']:.3f} "
              f"({report[name]['passes']} passes, {report[name]['seconds']:.0f} s)", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "t1_engine.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
