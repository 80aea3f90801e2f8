"""Drafter training throughput (tokens/s, MFU) on synthetic data.

  python -m dspine_benchmarks.train_throughput --target preset:smollm2-135m --kind dspine
  python -m dspine_benchmarks.train_throughput --config train/configs/qwen3_8b_dspine.toml \
      --target preset:qwen3-8b --set run.batch_size=8 --steps 20

--config FILE runs that training config (its drafter, loss, batch, sequence length and
blocks; --set overrides any field) on --target, in place of the --kind ... --logits
options, which it refuses.

Writes a dataset of random token sequences (throughput does not depend on their content),
runs `dspine train` for --steps steps and reports the steady-state figures the trainer
logs (the first, compiling step excluded). MFU counts matmul FLOPs (target forward,
drafter forward + backward, vocabulary products) against the 989 TFLOP/s bf16 peak.

--profile N traces ten steps after the compiling one with jax.profiler and lists the N
operations with the most device time per step (profile_step's summary), with the time
in matmul kernels, XLA's TopK and everything else, and the JAX operation each kernel
runs (`hlo_names`). The profiled run's tokens/s includes the tracing.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import tempfile
from datetime import date
from pathlib import Path

import numpy as np

from dspine_benchmarks import hlo_names
from dspine_benchmarks.profile_step import device_events, summarise, top_table
from dspine_jax.data.shards import Sequence, write_manifest, write_shard
from dspine_train.config import TRAINING_ATTENTION, from_dict, load_config
from dspine_train.trainer import train

# The options --config replaces (it sets the drafter, the loss and the batch's shape).
CONFIG_OPTIONS = ("kind", "layers", "batch", "seq_len", "blocks", "target_attention",
                  "drafter_attention", "candidates", "backbone", "alignment", "logits")


def synthetic_dataset(folder: Path, vocab: int, num: int, seq_len: int, prompt: int) -> None:
    rng = np.random.default_rng(0)
    seqs = [Sequence(rng.integers(0, vocab, seq_len).astype(np.int32),
                     np.arange(seq_len) >= prompt) for _ in range(num)]
    name = write_shard(folder, 0, seqs)
    write_manifest(folder, {"settings": {"source": "synthetic"}, "shards": [
        {"file": name, "prompts": num, "sequences": num, "tokens": num * seq_len,
         "response_tokens": num * (seq_len - prompt)}], "skipped_long_prompts": 0})


def kernel_kind(name: str, op: str = "") -> str:
    """matmul, topk or other, from a kernel's name and the JAX operation it runs (cuBLAS's
    Hopper kernels are "nvjet_*"; XLA's TopK kernel is "stream_executor::cuda::Run<k, ...>")."""
    low, op = name.lower(), op.lower()
    xla_top_k = low.startswith("void stream_executor::") and "::run<" in low
    if "top_k" in op or "topk" in low or "top_k" in low or xla_top_k:
        return "topk"
    if any(w in low for w in ("gemm", "cublas", "cutlass", "xmma", "dot", "matmul", "nvjet")):
        return "matmul"
    return "other"


def traced(folder: Path, steps: int, top: int, op_names: dict[str, str]) -> dict:
    """Device time per step of a trace the trainer wrote, by kind and by operation."""
    import gzip
    from collections import Counter

    [path] = sorted(folder.rglob("*.trace.json.gz"))[-1:]
    with gzip.open(path) as f:
        events = device_events(json.load(f))
    kinds = Counter()
    for e in events:
        kinds[kernel_kind(e["name"], op_names.get(e["name"], ""))] += e["dur"] / steps
    return {**summarise(events, steps, top, op_names), "by_kind_us": dict(kinds)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default="preset:smollm2-135m")
    p.add_argument("--kind", default="dspine")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--target-attention", default="auto", choices=TRAINING_ATTENTION,
                   help="the frozen target's attention (target.attention)")
    p.add_argument("--drafter-attention", default="auto", choices=TRAINING_ATTENTION,
                   help="the drafter's attention (drafter.attention)")
    p.add_argument("--candidates", default="auto", choices=("auto", "logits", "kernel"),
                   help="loss.candidates: the DSpine refinement's top-k from the logits or "
                        "from vocab_top_k of the hidden states (auto: kernel on a GPU)")
    p.add_argument("--backbone", default=None, choices=("ce", "ce+l1"),
                   help="loss.backbone (default: the drafter's own: ce for DFlash, ce+l1 for "
                        "DSpine)")
    p.add_argument("--alignment", default="on", choices=("on", "off"),
                   help="loss.alignment (DSpine; the shipped recipe: --backbone ce "
                        "--alignment off)")
    p.add_argument("--logits", default="auto", choices=("auto", "dense", "fused"),
                   help="loss.logits: the [B, n, K, V] logits (dense) or lm_head_stats "
                        "from the hidden states (fused; a CE backbone); auto: fused on a "
                        "GPU where the loss and the drafter's width allow it")
    p.add_argument("--analysis", action="store_true",
                   help="also report XLA's FLOPs, bytes accessed and temporary memory of the "
                        "compiled step")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="trace the run and list the N costliest operations per step")
    p.add_argument("--config", type=Path, default=None, metavar="FILE",
                   help="a training config to run (on --target, synthetic data) instead of "
                        "the options above")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="with --config: override a field (repeatable)")
    args = p.parse_args(argv)
    own = [f"--{name.replace('_', '-')}" for name in CONFIG_OPTIONS
           if getattr(args, name) != p.get_default(name)]
    if args.config is not None and own:
        p.error(f"{', '.join(own)}: --config sets these; use --set section.key=value")
    if args.set and args.config is None:
        p.error("--set overrides fields of --config; give --config")
    with tempfile.TemporaryDirectory() as tmp:
        if args.profile:  # before anything compiles: the kernels' JAX operations
            hlo_names.dump_hlo_to(Path(tmp) / "hlo", "step")
        from dspine_jax.checkpoints import load_target

        vocab = load_target(args.target, dtype="f32", with_tokenizer=False).config.vocab_size
        data = Path(tmp) / "data"

        log_every = max(1, args.steps // 3)
        run = {"out": str(Path(tmp) / "run"), "steps": args.steps + 1, "log_every": log_every,
               "checkpoint_every": 10 ** 9}
        if args.config is not None:
            base = load_config(args.config, args.set)
            seq_len = base.data.seq_len
            cfg = dataclasses.replace(
                base, target=dataclasses.replace(base.target, name=args.target),
                data=dataclasses.replace(base.data, path=str(data), cached_features=False),
                run=dataclasses.replace(base.run, resume_from="", stop_after=0, max_seconds=0,
                                        **run))
        else:
            seq_len = args.seq_len
            cfg = from_dict({
                "target": {"name": args.target, "attention": args.target_attention},
                "drafter": {"kind": args.kind, "layers": args.layers, "mask_token_id": 1,
                            "attention": args.drafter_attention},
                "loss": {"candidates": args.candidates, "logits": args.logits,
                         "alignment": args.alignment == "on",
                         **({"backbone": args.backbone} if args.backbone else {})},
                "data": {"path": str(data), "seq_len": args.seq_len,
                         "blocks_per_seq": args.blocks},
                "run": {**run, "batch_size": args.batch},
            })
        data.mkdir()
        synthetic_dataset(data, vocab, 4 * cfg.run.batch_size, seq_len, seq_len // 4)
        traced_steps = min(10, args.steps - 1) if args.profile else 0
        trace = Path(tmp) / "trace" if args.profile else None
        analysis = {} if args.analysis else None
        summary = train(cfg, progress=False, trace_dir=trace, trace_steps=traced_steps,
                        analysis=analysis)
        if args.profile:
            hlo = Path(tmp) / "hlo"
            names = hlo_names.module_op_names(hlo, hlo_names.dumped_modules(hlo, "jit_step"))
            profile = traced(trace, traced_steps, args.profile, names)
        with open(Path(tmp) / "run" / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
    last = rows[-1]
    result = dict(target=args.target, kind=cfg.drafter.kind, layers=cfg.drafter.layers,
                  batch=cfg.run.batch_size, target_attention=cfg.target.attention,
                  drafter_attention=cfg.drafter.attention,
                  candidates=cfg.loss.candidates, backbone=cfg.loss.backbone,
                  alignment="on" if cfg.loss.alignment else "off", logits=cfg.loss.logits,
                  config=str(args.config) if args.config else None, set=args.set,
                  peak_device_memory_bytes=summary.get("peak_device_memory_bytes"),
                  seq_len=cfg.data.seq_len, blocks_per_seq=cfg.data.blocks_per_seq,
                  step_seconds=cfg.run.batch_size * cfg.data.seq_len / float(last["tokens_per_s"]),
                  tokens_per_s=float(last["tokens_per_s"]),
                  mfu=float(last["mfu"]) if last.get("mfu") else None,
                  loss=float(last["loss"]), date=str(date.today()))
    if analysis:
        result["analysis"] = analysis
    if args.profile:
        result["profile"] = profile
        print(f"device time per step {profile['device_us_per_pass'] / 1e3:.1f} ms: "
              + ", ".join(f"{k} {v / 1e3:.1f}" for k, v in profile["by_kind_us"].items()))
        print(top_table(profile["top"]))
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
