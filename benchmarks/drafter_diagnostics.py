"""Why a drafter accepts what it accepts: per-slot accuracy, DSpine's chain head, gates per
layer and what each layer already predicts (a logit lens: each layer's output through the
final norm and the lm_head; for DSpine also its feature's nearest code), on the target's
own greedy continuations of held-out ShareGPT prompts (data no drafter trained on).

    python -m dspine_benchmarks.drafter_diagnostics --drafter DIR [--drafter DIR ...] --out DIR

Teacher-forced: every block sees the true context, as in training. The engine's real
acceptance is checked against the same rule at the anchors the engine actually used
(they must agree token for token at T=0, or inference and training compute different
things). Writes diagnostics.json and diagnostics.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dspine_jax.api import Pipeline, Prompt
from dspine_jax.checkpoints import load_target
from dspine_jax.data.prompts import sharegpt_prompts
from dspine_jax.drafters.checkpoint import load_drafter
from dspine_jax.drafters.model import DraftOutput
from dspine_jax.registry import resolve_drafter
from dspine_jax.sampling import SamplingParams
from dspine_jax.speculative.policy import SpeculationConfig


def accepted(pred: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """[..., S] predictions vs labels -> tokens emitted per pass (prefix + bonus)."""
    ok = np.concatenate([pred == labels, np.zeros(pred.shape[:-1] + (1,), bool)], -1)
    return np.argmin(ok, -1) + 1


def base_tokens(out: DraftOutput) -> np.ndarray:
    """Per-slot argmax of one sequence's blocks [n, K-1] (DFlash's greedy draft)."""
    return np.asarray(jnp.argmax(out.logits[0, :, 1:], -1))


def chain_tokens(drafter, out: DraftOutput, anchor_tokens: np.ndarray, e_out) -> np.ndarray:
    """DSpine's greedy chain draft [n, K-1]: the sequence's n blocks decoded as a batch of
    one-block drafts, exactly as the engine decodes one block."""
    blocks = DraftOutput(logits=out.logits[0][:, None], hidden=out.hidden[0][:, None],
                         pre_injection=out.pre_injection[0][:, None], features=None,
                         gates=None)
    greedy = SamplingParams.create(len(anchor_tokens), 0.0, 1.0, 0)
    return np.asarray(drafter.proposer().propose(blocks, jnp.asarray(anchor_tokens), e_out,
                                                 greedy, jax.random.key(0)).tokens)


def teacher_forced(model, drafter, tokens: np.ndarray, anchors: np.ndarray):
    """The training forward over one sequence: blocks at `anchors` see the true context.
    Returns the DraftOutput and each block's labels [n, K-1]."""
    toks = jnp.asarray(tokens[None])
    feats = model(toks, hidden_layer_ids=drafter.config.target_layer_ids,
                  return_logits=False).features()
    out = drafter.forward_train(toks, feats, jnp.asarray(anchors[None]),
                                model.input_embedding(), model.output_embedding(),
                                keep_layers=True)
    k = drafter.config.block_size
    return out, tokens[anchors[:, None] + np.arange(1, k)]


def logit_lens(drafter, out: DraftOutput, e_out) -> np.ndarray:
    """Each layer's greedy prediction per slot [L, n, K-1]: its output through the final
    norm and the lm_head, as if the drafter ended there (the last layer's is the base
    head's)."""
    final = drafter.norm(out.layers[:, 0, :, 1:])                       # [L, n, S, D]
    return np.asarray(jnp.argmax(jnp.einsum("LnSD,VD->LnSV", final.astype(jnp.float32),
                                            e_out.astype(jnp.float32)), -1))


def diagnose(loaded, drafter, sequences, stride: int) -> dict:
    model = loaded.model
    e_out = model.output_embedding()
    k = drafter.config.block_size
    spine = drafter.config.dspine is not None
    base_hits, chain_hits, base_tau, chain_tau, layer_hits, gates = [], [], [], [], [], []
    lens_hits = []
    codes = drafter.code_table(e_out) if spine else None                # [V, r]
    for tokens, prompt_len in sequences:
        anchors = np.arange(prompt_len, len(tokens) - k + 1, stride, dtype=np.int32)
        if len(anchors) == 0:
            continue
        out, labels = teacher_forced(model, drafter, tokens, anchors)    # labels [n, S]
        base = base_tokens(out)                                          # [n, S]
        base_hits.append(base == labels)
        base_tau.append(accepted(base, labels))
        lens_hits.append(logit_lens(drafter, out, e_out) == labels[None])    # [L, n, S]
        if spine:
            chain = chain_tokens(drafter, out, tokens[anchors], e_out)
            chain_hits.append(chain == labels)
            chain_tau.append(accepted(chain, labels))
            feats_l = np.asarray(out.features[:, 0, :, 1:])             # [L, n, S, r]
            nearest = np.argmax(feats_l @ codes.T, -1)                  # [L, n, S]
            layer_hits.append(nearest == labels[None])
            gates.append(np.asarray(out.gates))

    def survival(taus):  # P(slots 1..s all accepted), s = 1..K-1: tau = 1 + its sum
        taus = np.concatenate(taus)
        return [float(np.mean(taus >= s + 1)) for s in range(1, k)]

    report = {"blocks": int(sum(len(h) for h in base_hits)),
              "base_slot_accuracy": np.concatenate(base_hits).mean(0).tolist(),
              "base_prefix_survival": survival(base_tau),
              "base_tau": float(np.concatenate(base_tau).mean()),
              # [L][S]: slot s's accuracy of layer l's logit lens
              "layer_lens_slot_accuracy": np.concatenate(lens_hits, 1).mean(1).tolist(),
              "layer_lens_accuracy": np.concatenate(lens_hits, 1).mean((1, 2)).tolist()}
    if spine:
        report.update(
            chain_slot_accuracy=np.concatenate(chain_hits).mean(0).tolist(),
            chain_prefix_survival=survival(chain_tau),
            chain_tau=float(np.concatenate(chain_tau).mean()),
            layer_code_accuracy=np.concatenate(layer_hits, 1).mean((1, 2)).tolist(),
            gate_mean_per_layer=np.mean(gates, 0).tolist())
    return report


def engine_check(pipe: Pipeline, drafter, prompts, max_new_tokens: int, loaded) -> dict:
    """Engine pass lengths vs the teacher-forced rule at the engine's own anchors (T=0)."""
    model = loaded.model
    e_out = model.output_embedding()
    k = drafter.config.block_size
    spine = drafter.config.dspine is not None
    results = pipe.generate(prompts, max_new_tokens=max_new_tokens, batch_size=len(prompts))
    engine, forced = [], []
    for prompt, r in zip(prompts, results):
        ids = pipe.encode(prompt)
        tokens = np.asarray(ids + r.tokens, np.int32)
        lens = np.asarray(r.accept_lengths[:-1])  # the last pass may be cut by the budget
        anchors = (len(ids) + np.concatenate([[0], np.cumsum(lens)[:-1]])).astype(np.int32)
        keep = anchors + k <= len(tokens)
        anchors, lens = anchors[keep], lens[keep]
        if len(anchors) == 0:
            continue
        out, labels = teacher_forced(model, drafter, tokens, anchors)
        pred = chain_tokens(drafter, out, tokens[anchors], e_out) if spine else base_tokens(out)
        engine.append(lens)
        forced.append(accepted(pred, labels))
    engine, forced = np.concatenate(engine), np.concatenate(forced)
    return {"passes": int(len(engine)), "engine_tau": float(engine.mean()),
            "teacher_forced_tau": float(forced.mean()),
            "agreement": float((engine == forced).mean())}


def plot(reports: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(24, 4))
    for name, rep in reports.items():
        slots = np.arange(1, len(rep["base_slot_accuracy"]) + 1)
        for head in ("base", "chain"):
            if f"{head}_slot_accuracy" in rep:
                label = f"{name} {head} head"
                axes[0].plot(slots, rep[f"{head}_slot_accuracy"], marker="o", label=label)
                axes[1].plot(slots, rep[f"{head}_prefix_survival"], marker="o",
                             label=f"{label} (tau {rep[f'{head}_tau']:.2f})")
        if "layer_lens_accuracy" in rep:
            axes[2].plot(np.arange(len(rep["layer_lens_accuracy"])),
                         rep["layer_lens_accuracy"], marker="o", label=name)
        if "layer_code_accuracy" in rep:
            layers = np.arange(len(rep["layer_code_accuracy"]))
            axes[3].plot(layers, rep["layer_code_accuracy"], marker="o", label=name)
            axes[4].plot(layers, rep["gate_mean_per_layer"], marker="o", label=name)
    axes[0].set(title="per-slot accuracy (teacher-forced)", xlabel="block slot", ylim=(0, 1))
    axes[1].set(title="P(slots 1..s all accepted)", xlabel="s", ylim=(0, 1))
    axes[2].set(title="logit lens: layer's argmax = label (slots 1..)", xlabel="draft layer")
    axes[3].set(title="DSpine: layer feature's nearest code = label", xlabel="draft layer")
    axes[4].set(title="DSpine: mean gate per layer", xlabel="draft layer", ylim=(0, 1))
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_heldout_args(parser) -> None:
    """The target, and which held-out prompts it continues (`heldout_prompts`,
    `continuations`): the options every diagnostics script shares."""
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=512,
                        help="use the first held-out prompts at most this long")


def heldout_prompts(ar: Pipeline, n: int, max_prompt_tokens: int) -> list[Prompt]:
    """The first n held-out ShareGPT prompts (chat template) of at most max_prompt_tokens."""
    held_out = (Prompt(p["prompt"], True) for p in sharegpt_prompts("heldout"))
    return [p for p in held_out if len(ar.encode(p)) <= max_prompt_tokens][:n]


def continuations(ar: Pipeline, prompts, max_new_tokens: int, temperature: float = 0.0,
                  seed: int = 0):
    """The target's own continuations: [(tokens [T] int32, prompt length)]."""
    results = ar.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                          seed=seed, batch_size=len(prompts))
    return [(np.asarray(ar.encode(p) + r.tokens, np.int32), len(ar.encode(p)))
            for p, r in zip(prompts, results)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_heldout_args(parser)
    parser.add_argument("--drafter", action="append", required=True)
    parser.add_argument("--stride", type=int, default=4, help="anchor every N tokens")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    loaded = load_target(args.target, dtype=args.dtype)
    ar = Pipeline.from_loaded(loaded)
    prompts = heldout_prompts(ar, args.prompts, args.max_prompt_tokens)
    sequences = continuations(ar, prompts, args.max_new_tokens)
    reports = {}
    base = [Path(f).name for f in args.drafter]     # two runs' `drafter` folders: named
    names = {f: f"{Path(f).parent.name}/{b}" if base.count(b) > 1 else b   # by their runs
             for f, b in zip(args.drafter, base)}
    for folder in args.drafter:
        drafter = load_drafter(resolve_drafter(folder), dtype=loaded.model.dtype)
        name = names[folder]
        reports[name] = diagnose(loaded, drafter, sequences, args.stride)
        pipe = Pipeline.from_loaded(loaded, folder, speculation=SpeculationConfig("fixed"))
        reports[name]["engine_check"] = engine_check(pipe, drafter, prompts,
                                                     args.max_new_tokens, loaded)
        print(name, json.dumps(reports[name]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "diagnostics.json").write_text(json.dumps(reports, indent=2))
    plot(reports, args.out / "diagnostics.png")


if __name__ == "__main__":
    main()
