"""The PyTorch speculative loop (transformers' target + `dspine_torch` drafters and
kernels) against the JAX engine, on the same weights, prompts and settings: output
tokens/s and tokens per verify pass (tau) for AR and every drafter, per batch size.

    python -m dspine_benchmarks.loop_vs_engine \
        --drafter smollm2-135m-instruct-dflash --drafter smollm2-135m-instruct-dspine \
        --prompts prompts.jsonl --num-prompts 16 --batch 1 8 --max-new-tokens 128 \
        --out loop_vs_engine.json

The target (default: the built-in SmolLM2-135M-Instruct) is loaded once by JAX and
written as an HF folder (`save_target`) that transformers reads, so both sides hold the
same dequantised weights in the same dtype. Prompts: JSONL as for `dspine generate
--prompts-file` ({"prompt": text, "chat": bool}), the first --num-prompts of them; every
row decodes exactly --max-new-tokens (EOS ignored), so both sides emit the same number of
tokens.

Timing: each (side, method, batch) first decodes once untimed (JAX: every batch, which
compiles its programs; PyTorch: one batch, to autotune), then decodes all prompts in
batches; tokens/s = all new tokens / decode seconds (JAX: the engine's own wall time,
compilation excluded; PyTorch: wall time with the device synchronised); first_run_seconds
sums JAX's untimed runs, which include XLA's one-time setup of every program.
--steps-per-call 4 16 times every JAX method with 4 and with 16 target passes per host
call (each its own compiled engine over the same target). JAX rows also split the
engine's time: prefill_seconds (until the first tokens are read), batch_passes (per
batch, the most passes any of its rows took: a batch decodes until then), pass_ms =
decode seconds / batch_passes (comparable with `spec_step`'s pass time) and
row_pass_share = the rows' own passes / the passes their batches ran.
PyTorch AR is `model.generate` (greedy, dynamic cache) over left-padded batches.

At T = 0 the report also gives the share of rows whose tokens are identical on both sides
and their mean common prefix: in bf16, near-ties flip argmaxes differently on the two
sides, so this is an agreement rate, not an exactness check (exactness is checked by
`dspine parity` in float32). --skip-torch times the JAX engine alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

from dspine_jax.runtime.offline import generate_tokens
from dspine_jax.speculative.policy import SpeculationConfig


def passes_by_width(generations) -> dict[str, int]:
    """The target passes at each verify width over `generations` (what adaptive speculation
    picked; a fixed drafter's every pass is at its whole block, AR's at width 0), keyed by
    width as text for JSON."""
    widths: dict[int, int] = {}
    for g in generations:
        for w, n in g.verify_widths.items():
            widths[w] = widths.get(w, 0) + n
    return {str(w): n for w, n in sorted(widths.items())}


def time_engine(pipe, groups, batch, drafter, kw, repeats: int = 1):
    """Decode every group once untimed (the first run of a newly compiled shape also pays
    XLA's setup), then `repeats` times: (tokens, accept lengths, seconds, row fields) of
    the timed run with the median total seconds; `seconds_runs` lists every timed run."""
    first_run = sum(generate_tokens(pipe.decoder, group, seed=i * batch, **kw).seconds
                    for i, group in enumerate(groups))
    runs = [[generate_tokens(pipe.decoder, group, seed=i * batch, **kw)
             for i, group in enumerate(groups)] for _ in range(repeats)]
    totals = [sum(r.seconds for r in run) for run in runs]
    median = sorted(range(repeats), key=totals.__getitem__)[(repeats - 1) // 2]
    toks, accepts, prefill = [], [], 0.0
    batch_passes = slots = row_passes = 0
    for res in runs[median]:
        prefill += res.prefill_seconds
        toks += [list(g.tokens) for g in res.generations]
        accepts += [list(g.accept_lengths) if drafter else [1] * len(g.tokens)
                    for g in res.generations]
        # decode passes per row (the prefill emits the first token), and a batch decodes
        # until its row with the most passes is done
        passes = [len(g.accept_lengths) if drafter else len(g.tokens) - 1
                  for g in res.generations]
        batch_passes += max(passes)
        slots += max(passes) * len(res.generations)
        row_passes += sum(passes)
    seconds = totals[median]
    fields = dict(prefill_seconds=round(prefill, 4), batch_passes=batch_passes,
                  pass_ms=round(1e3 * (seconds - prefill) / batch_passes, 3),
                  row_pass_share=round(row_passes / slots, 3),
                  first_run_seconds=round(first_run, 4),
                  seconds_runs=[round(t, 4) for t in totals])
    widths = passes_by_width(g for res in runs[median] for g in res.generations)
    if widths:
        fields["verify_widths"] = widths
    return toks, accepts, seconds, fields


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target (default: the built-in one)")
    ap.add_argument("--drafter", action="append", default=[], help="repeatable")
    ap.add_argument("--prompts", required=True, help="JSONL prompts")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--torch-implementation", nargs="+", default=["triton"],
                    choices=["triton", "torch"], help="kernels of the PyTorch loop")
    ap.add_argument("--skip-ar", action="store_true")
    ap.add_argument("--skip-torch", action="store_true",
                    help="time the JAX engine only (no transformers target is built)")
    ap.add_argument("--steps-per-call", type=int, nargs="+", default=None,
                    help="JAX: target passes per host call of the engine, each value timed "
                         "in turn (default: the pipeline's, 16 offline)")
    ap.add_argument("--out", default=None, help="JSON, rewritten after every row")
    return ap.parse_args(argv)


def read_prompts(path: str, n: int):
    """The first n prompts of a JSONL file (the format of `dspine generate --prompts-file`),
    checked before anything loads."""
    from dspine_cli.main import read_prompts_file
    from dspine_jax.errors import InputError

    prompts = read_prompts_file(Path(path), default_chat=False)[:n]
    if len(prompts) < n:
        raise InputError(f"{path}: {len(prompts)} prompts, --num-prompts asks for {n}")
    return prompts


def batches(prompts, size):
    return [prompts[i:i + size] for i in range(0, len(prompts), size)]


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv=None):
    args = parse(argv)
    sys.stdout.reconfigure(line_buffering=True)
    import jax
    import torch
    import transformers

    import dspine_torch
    from dspine_jax.api import Pipeline
    from dspine_jax.checkpoints import load_target, save_target
    from dspine_jax.registry import DEFAULT_TARGET, resolve_drafter
    from dspine_torch.speculative import Sampling, generate_batch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tdtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    texts = read_prompts(args.prompts, args.num_prompts)
    loaded = load_target(args.target or DEFAULT_TARGET, dtype=args.dtype)
    encode = Pipeline.from_loaded(loaded).encode
    prompts = [encode(p) for p in texts]
    hf_target = None
    if not args.skip_torch:
        folder = Path(tempfile.mkdtemp(prefix="loop_vs_engine_"))
        save_target(loaded.model, folder)
        hf_target = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=tdtype).eval().to(device)
    new = args.max_new_tokens
    meta = {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
            "jax_device": str(jax.devices()[0].device_kind), "torch": torch.__version__,
            "torch_device": (torch.cuda.get_device_name() if device.type == "cuda"
                             else "cpu"), "dtype": args.dtype, "prompts": args.prompts,
            "num_prompts": len(prompts), "max_new_tokens": new,
            "temperature": args.temperature}
    rows, outputs = [], {}

    def record(side, method, batch, impl, gens_tokens, accept_lengths, seconds, fields=None,
               **extra):
        extra = {**(fields or {}), **extra}
        tokens = sum(len(t) for t in gens_tokens)
        passes = sum(len(a) for a in accept_lengths)
        row = {"side": side, "method": method, "batch": batch, "implementation": impl,
               "tokens": tokens, "seconds": round(seconds, 4),
               "tokens_per_s": round(tokens / seconds, 1),
               "tau": round(tokens / passes, 3) if passes else None, **extra}
        outputs[(side, method, batch, impl)] = gens_tokens
        jax_rows = outputs.get(("jax", method, batch, "engine"))
        if side == "torch" and jax_rows is not None and args.temperature == 0:
            same = [a == b for a, b in zip(jax_rows, gens_tokens)]
            row["rows_identical"] = round(sum(same) / len(same), 3)
            row["mean_common_prefix"] = round(sum(
                common_prefix(a, b) for a, b in zip(jax_rows, gens_tokens)) / len(same), 1)
        rows.append(row)
        print(json.dumps(row))
        if args.out:
            Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))

    methods = ([] if args.skip_ar else [("ar", None)]) + [
        (Path(str(resolve_drafter(d))).name, d) for d in args.drafter]
    for method, drafter in methods:
        pipes = {n: Pipeline.from_loaded(loaded, drafter, method=None if drafter else "ar",
                                         steps_per_call=n, speculation=(
                                             SpeculationConfig("fixed") if drafter else None))
                 for n in args.steps_per_call or [None]}
        torch_drafter = (dspine_torch.load_drafter(resolve_drafter(drafter), dtype=tdtype)
                         .to(device) if drafter and hf_target is not None else None)
        for b in args.batch:
            groups = batches(prompts, b)
            kw = {"max_new_tokens": new, "temperature": args.temperature, "ignore_eos": True}
            for pipe in pipes.values():
                record("jax", method, b, "engine", *time_engine(pipe, groups, b, drafter, kw),
                       steps_per_call=pipe.decoder.steps_per_call)
            if hf_target is None:
                continue
            for impl in (args.torch_implementation if drafter else ["generate"]):
                toks, accepts, seconds = [], [], 0.0
                for i, group in enumerate([groups[0]] + groups):    # the first: warm-up
                    sync()
                    t0 = time.perf_counter()
                    if drafter:
                        gens = generate_batch(
                            hf_target, torch_drafter, group, max_new_tokens=new,
                            sampling=Sampling(temperature=args.temperature), seed=i * b,
                            ignore_eos=True, implementation=impl)
                        got = [(list(g.tokens), list(g.accept_lengths)) for g in gens]
                    else:
                        got = [(t, [1] * len(t)) for t in hf_generate(
                            hf_target, group, new, args.temperature, device)]
                    sync()
                    if i:
                        seconds += time.perf_counter() - t0
                        toks += [t[:new] for t, _ in got]
                        accepts += [a for _, a in got]
                record("torch", method, b, impl, toks, accepts, seconds)
        del torch_drafter
    print(f"done: {len(rows)} rows")


def hf_generate(model, group, new, temperature, device):
    """transformers' own decoding of a left-padded batch, exactly `new` tokens per row."""
    import torch

    width = max(len(p) for p in group)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in group], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group],
                        device=device)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                         min_new_tokens=new, do_sample=temperature > 0,
                         temperature=temperature or None, top_p=None, top_k=None,
                         pad_token_id=0, eos_token_id=None)
    return [row.tolist() for row in out[:, width:]]


if __name__ == "__main__":
    main()
