"""`dspine eval`: acceptance length, tokens/s and speedup over AR, per benchmark.

Every method decodes the same prompts with the same engine and settings; AR always runs
as the baseline. Acceptance length tau = tokens emitted per target verify pass (bonus
included), pooled over a benchmark's prompts; tokens/s = generated tokens / decode wall
time (compilation excluded); speedup = a method's tokens/s over AR's on that benchmark.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from dspine_jax.api import (MethodChoice, Pipeline, Prompt, check_attention_backend,
                            check_proposal, check_speculation, resolve_method)
from dspine_jax.checkpoints import load_target, resolve_dtype
from dspine_jax.decoding import mean_accept_length
from dspine_jax.drafters import DEFAULT_PROPOSAL, DEFAULT_PROPOSAL_KERNEL
from dspine_jax.errors import InputError
from dspine_jax.evaluation.benchmarks import load_benchmark
from dspine_jax.runtime.offline import generate_tokens
from dspine_jax.speculative.policy import SpeculationConfig


def fitting_prompts(pipe: Pipeline, prompts: list[dict], room: int,
                    max_new_tokens: int) -> tuple[list[list[int]], int]:
    """(token ids of the prompts of at most `room` tokens, how many were longer): the
    longer ones are counted, not cut."""
    encoded = [pipe.encode(Prompt(p["prompt"], p["chat"])) for p in prompts]
    fitting = [ids for ids in encoded if len(ids) <= room]
    if not fitting:
        raise InputError(f"no prompt fits the context with max_new_tokens="
                         f"{max_new_tokens}; lower it")
    return fitting, len(prompts) - len(fitting)


def run_method(pipe: Pipeline, fitting: list[list[int]], skipped: int, *, batch_size: int,
               **options) -> dict:
    """Decode the prompts that fit (the same set for every method) through `batch_size`
    slots; programs compile on first use, outside the timed seconds."""
    batch = generate_tokens(pipe.decoder, fitting, max_slots=batch_size, **options)
    accept_lengths: list[int] = []
    widths: Counter = Counter()   # passes per verify width
    for g in batch.generations:
        accept_lengths += g.accept_lengths
        widths.update(g.verify_widths)
    tokens = sum(len(g.tokens) for g in batch.generations)
    return {"prompts": len(fitting), "skipped_too_long": skipped,
            "tokens": tokens, "seconds": batch.seconds,
            "compile_seconds": batch.compile_seconds,
            "tokens_per_second": tokens / max(batch.seconds, 1e-9),
            "accept_length": mean_accept_length(accept_lengths),  # pooled over prompts
            "verify_widths": {str(w): widths[w] for w in sorted(widths)}}


def run_benchmark(pipes: dict[str, Pipeline], prompts: list[dict], *, batch_size: int,
                  room: int, **options) -> dict[str, dict]:
    """Every method on one benchmark, one after the other, so timings never overlap."""
    # Every method's pipeline shares the target's tokenizer: encode once.
    fitting, skipped = fitting_prompts(pipes["ar"], prompts, room, options["max_new_tokens"])
    return {label: run_method(pipe, fitting, skipped, batch_size=batch_size, **options)
            for label, pipe in pipes.items()}


def drafter_labels(methods: list[str], paths: list[str]) -> list[str]:
    """Column names: the method alone when it is the only drafter of its kind, else
    `method:name` for every drafter of that kind (name: the run folder of an export such
    as `.../drafter` or `.../drafter-bf16`, else the folder or built-in name), so no
    column is ambiguous."""
    def name(path: str) -> str:
        folder = Path(path)
        export = folder.name == "drafter" or folder.name.startswith("drafter-")
        return folder.parent.name if export and folder.parent.name else folder.name

    counts = Counter(methods)
    labels = []
    for method, path in zip(methods, paths):
        label = method if counts[method] == 1 else f"{method}:{name(path)}"
        while label in labels or label == "ar":
            label += "'"
        labels.append(label)
    return labels


def evaluate(target: str, drafters: list[str], benchmarks: list[str], out: Path, *,
             temperature: float = 0.0, max_new_tokens: int = 256, limit: int | None = None,
             batch_size: int = 8, seed: int = 0, dtype: str = "auto",
             max_prompt_tokens: int | None = None, attention_backend: str = "auto",
             proposal: str = DEFAULT_PROPOSAL,
             proposal_kernel: str = DEFAULT_PROPOSAL_KERNEL,
             speculation: SpeculationConfig | None = None) -> dict:
    """Every method on every benchmark, side by side (see the module's docstring).
    `speculation` defaults to fixed: every pass verifies the whole block, so the acceptance
    length measures the drafter; adaptive reports the speed a user of `generate` gets."""
    # Every check before the target loads (seconds to minutes): the output folder, the
    # drafters (each decodes with its own kind), the dtype, the proposal path (every
    # drafter's; without drafters only AR runs) and the benchmark prompts.
    out = Path(out)
    check_out_folder(out)
    check_proposal(proposal, proposal_kernel)
    choices = [resolve_method(target, d, None) for d in drafters]
    drafters = [str(c.drafter) for c in choices]
    check_proposal(proposal, proposal_kernel, None if choices else "ar")
    if speculation is not None and not choices:
        check_speculation(speculation, MethodChoice("ar", None))   # refused: nothing drafts
    speculation = speculation or SpeculationConfig("fixed")
    for choice in choices:
        check_speculation(speculation, choice)
    resolve_dtype(dtype)
    check_attention_backend(attention_backend)
    suites = {name: load_benchmark(name)[:limit] for name in benchmarks}
    loaded = load_target(target, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    pipes = {"ar": Pipeline.from_loaded(loaded, attention_backend=attention_backend)}
    drafter_pipes = [Pipeline.from_choice(loaded, choice, attention_backend=attention_backend,
                                          proposal=proposal, proposal_kernel=proposal_kernel,
                                          speculation=speculation)
                     for choice in choices]
    for label, pipe in zip(drafter_labels([p.method for p in drafter_pipes], drafters),
                           drafter_pipes):
        pipes[label] = pipe
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    room = (loaded.config.max_position_embeddings - max_new_tokens
            - max(p.decoder.extra_capacity for p in pipes.values()))
    if max_prompt_tokens is not None:  # fewer shape buckets; longer prompts are counted
        room = min(room, max_prompt_tokens)
    table: dict[str, dict[str, dict]] = {}
    for name in tqdm(benchmarks, desc="benchmarks"):
        row = run_benchmark(pipes, suites[name], batch_size=batch_size, room=room, **options)
        for result in row.values():
            result["speedup"] = result["tokens_per_second"] / row["ar"]["tokens_per_second"]
        table[name] = row
    mean = {label: {key: sum(table[b][label][key] for b in benchmarks) / len(benchmarks)
                    for key in ("accept_length", "tokens_per_second", "speedup")}
            for label in pipes}
    report = {"target": target, "drafters": drafters, "temperature": temperature,
              "max_new_tokens": max_new_tokens, "limit": limit, "batch_size": batch_size,
              "max_prompt_tokens": room,
              "attention_backend": pipes["ar"].decoder.attention.name,
              "proposal": proposal, "proposal_kernel": proposal_kernel,
              **speculation.to_json(),
              "benchmarks": table, "mean": mean}
    (out / "results.json").write_text(json.dumps(report, indent=2))
    (out / "results.md").write_text(markdown(report))
    plot(report, out / "acceptance.png")
    return report


OUTPUTS = ("results.json", "results.md", "acceptance.png")


def check_out_folder(out: Path) -> None:
    """Refuse a folder that holds an earlier run's results: a second run into it would
    replace them without a trace."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file, not a folder")
    earlier = [name for name in OUTPUTS if (out / name).exists()]
    if earlier:
        raise InputError(f"--out {out} already holds results of an earlier run "
                         f"({', '.join(earlier)}); pass a new folder, or delete those files "
                         "to run again in place")


def markdown(report: dict) -> str:
    labels = list(report["mean"])
    head = "| benchmark | " + " | ".join(f"{m} tau | {m} tok/s | {m} speedup" for m in labels)
    lines = [head + " |", "|---" * (1 + 3 * len(labels)) + "|"]
    rows = list(report["benchmarks"].items()) + [("**mean**", report["mean"])]
    for name, row in rows:
        cells = [f"{row[m]['accept_length']:.2f} | {row[m]['tokens_per_second']:.1f} | "
                 f"{row[m]['speedup']:.2f}x" for m in labels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return (f"Target {report['target']}, T = {report['temperature']}, max_new_tokens "
            f"{report['max_new_tokens']}, limit {report['limit']}, batch {report['batch_size']}"
            "\n\n" + "\n".join(lines) + "\n")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(report["benchmarks"]) + ["mean"]
    labels = list(report["mean"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    width = 0.8 / len(labels)
    for ax, key, title in [(axes[0], "accept_length", "acceptance length (tau)"),
                           (axes[1], "speedup", "speedup over AR")]:
        for i, label in enumerate(labels):
            values = [report["benchmarks"][n][label][key] for n in names[:-1]]
            values.append(report["mean"][label][key])
            ax.bar(np.arange(len(names)) + i * width, values, width, label=label)
        ax.set_xticks(np.arange(len(names)) + width * (len(labels) - 1) / 2, names, rotation=30)
        ax.set_title(f"{title}, T = {report['temperature']}")
    # one legend under both panels: inside, it covers the bars
    handles, texts = axes[0].get_legend_handles_labels()
    fig.legend(handles, texts, loc="lower center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
