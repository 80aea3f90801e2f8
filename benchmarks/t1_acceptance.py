"""Why DSpine's T=0 lead vanishes at T=1: the exact per-slot acceptance probability
alpha_i = sum_x min(p_i(x), q_i(x)) of every way to draft slot i, teacher-forced, and the
expected tokens per verify pass E = 1 + sum_k prod_{i<=k} alpha_i it implies.

    python -m dspine_benchmarks.t1_acceptance --out DIR [--prompts 16] [--max-new-tokens 128]

Contexts: the target's own continuations of held-out ShareGPT prompts, sampled at T=1
("sampled", what the engine sees at T=1) and greedy ("greedy", what the shipped drafters
trained on, and what the engine sees at T=0). At each anchor the true prefix is the
context; p_i is the target's T=1 distribution for slot i. Drafts compared (q_i):

  dflash.marginal@s     softmax(s * DFlash's slot logits)
  dspine.marginal@s     softmax(s * DSpine's base logits) (its backbone without the head)
  chain@s               DSpine's head as the engine samples it: softmax(s * scores) over the
                        top-C candidates of the base logits, given the TRUE predecessor (the
                        anchor for slot 1). The head scores any predecessor, so the row is
                        computed even where the predecessor is not among the previous slot's
                        candidates (the walk never gets there; the rate is reported).
  chain_full@s          the same refined state against the whole lm_head (no top-C cut)
  chain@s+mix=w         (1 - w) * chain@s + w * dspine.marginal@1
  chain@s+tail          chain@s inside the candidates with the marginal's mass there,
                        DSpine's marginal outside; DSpine's marginal alone where the
                        predecessor is not a candidate (so slot 1 is the marginal itself)
  mass_C.dspine/dflash  p's mass on the top-C candidates: the best a C-sparse q can do

s is a calibration factor (s < 1 flattens q: drafting at temperature 1/s). At T=0 the
analogue is alpha_i = [argmax q_i == the target's greedy token], on the greedy contexts;
the chain's is checked against the engine's own greedy walk (`t0.engine_rule`).
Writes t1_acceptance.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dspine_benchmarks.drafter_diagnostics import (accepted, add_heldout_args, chain_tokens,
                                                   continuations, heldout_prompts)
from dspine_jax.api import Pipeline
from dspine_jax.checkpoints import load_target
from dspine_jax.drafters.checkpoint import load_drafter
from dspine_jax.registry import resolve_drafter
from dspine_jax.sampling import top_k_indices
from dspine_jax.speculative.acceptance import (expected_tokens, mixture_overlap, overlap,
                                               overlap_sparse, spliced_overlap)

# n blocks of one sequence, S = K - 1 drafted slots, C candidates, V vocab, D hidden.
SCALES = (0.33, 0.5, 0.67, 0.8, 1.0, 1.25, 1.5, 2.0)
MIX_WEIGHTS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
CANDIDATES = (16, 32, 64, 128)   # C: the shipped head's 16 first


# ----- contexts and the target's side ------------------------------------------------------
def at_slots(x, anchors: np.ndarray, s: int):
    """x [T, ...] -> [n, S, ...] at positions anchor + i for i = 0 .. S-1: the position
    whose output predicts slot i + 1."""
    return x[anchors[:, None] + np.arange(s)]


def target_pass(model, tokens: np.ndarray, layer_ids):
    """One target forward: (features [1, T, F], T=1 probabilities of the next token [T, V])."""
    out = model(jnp.asarray(tokens[None]), hidden_layer_ids=layer_ids)
    return out.features(), jax.nn.softmax(out.logits[0].astype(jnp.float32), -1)


def drafter_pass(model, drafter, tokens: np.ndarray, features, anchors: np.ndarray):
    """The training forward: every block sees the true context -> DraftOutput."""
    return drafter.forward_train(jnp.asarray(tokens[None]), features,
                                 jnp.asarray(anchors[None]), model.input_embedding(),
                                 model.output_embedding())


# ----- DSpine's head given the true predecessor --------------------------------------------
def chain_given_truth(drafter, out, anchor_tokens, labels, e_out, c_max: int) -> dict:
    """The head's state for the true predecessors (the anchor for slot 1) and what it scores:
    base logits and the refined state's logits over the whole vocabulary [n, S, V], the
    base head's top-c_max candidates [n, S, c_max] (descending: any top-C is a prefix)."""
    base = out.logits[0, :, 1:]                                          # [n, S, V]
    preds = jnp.concatenate([anchor_tokens[:, None], labels[:, :-1]], 1)  # [n, S]
    refined = drafter.refined_state(out.pre_injection[0, :, 1:], preds[..., None],
                                    e_out)[..., 0, :]                    # [n, S, D]
    full = jnp.einsum("nsd,vd->nsv", refined, e_out.astype(refined.dtype),
                      preferred_element_type=jnp.float32)                # [n, S, V]
    return {"base": base, "full": full, "cands": top_k_indices(base, c_max), "labels": labels}


def top_c(head: dict, c: int):
    """The head with C candidates: (ids [n, S, C], their scores given the true predecessor
    [n, S, C] (= transition_scores), whether that predecessor is among the previous slot's
    candidates [n, S] (slot 1's, the anchor, always is))."""
    cands, labels = head["cands"][..., :c], head["labels"]
    in_prev = jnp.any(cands[:, :-1] == labels[:, :-1, None], -1)          # [n, S-1]
    pred_in = jnp.concatenate([jnp.ones_like(in_prev[:, :1]), in_prev], 1)
    return cands, jnp.take_along_axis(head["full"], cands, -1), pred_in


# ----- alphas --------------------------------------------------------------------------------
def chain_alphas(p, head: dict, c: int, mixtures: bool) -> dict:
    """The C-candidate head's variants at every scale s: alone, with the marginal's tail
    (the marginal at s, or at 1: `tail1`), mixed with the marginal."""
    a = {}
    cands, scores, pred_in = top_c(head, c)
    for s in SCALES:
        q = jax.nn.softmax(s * scores, -1)                               # [n, S, C]
        a[f"chain.C{c}@{s}"] = overlap_sparse(p, cands, q)
        for ms, tail in ((s, "tail"), (1.0, "tail1")):
            marginal = jax.nn.softmax(ms * head["base"], -1)            # [n, S, V]
            inside = jnp.take_along_axis(marginal, cands, -1)            # [n, S, C]
            mass = jnp.sum(inside, -1, keepdims=True)
            # The marginal's own split between C and the rest. A predecessor outside the
            # previous slot's candidates has no table row: the marginal alone there.
            row = jnp.where(pred_in[..., None], q, inside / mass)
            a[f"chain.C{c}@{s}+{tail}"] = spliced_overlap(p, cands, mass * row, marginal)
        for w in MIX_WEIGHTS if mixtures else ():
            a[f"chain.C{c}@{s}+mix={w}"] = mixture_overlap(
                p, cands, q, jax.nn.softmax(head["base"], -1), w)
    a[f"mass.C{c}.dspine"] = jnp.sum(jnp.take_along_axis(p, cands, -1), -1)
    a[f"pred_in.C{c}"] = pred_in.astype(jnp.float32)
    return a


def t1_alphas(p, flash_logits, head: dict) -> dict:
    """Every variant's alpha [n, S] against the target's T=1 p [n, S, V]."""
    a = {}
    for s in SCALES:
        a[f"dflash.marginal@{s}"] = overlap(p, jax.nn.softmax(s * flash_logits, -1))
        a[f"dspine.marginal@{s}"] = overlap(p, jax.nn.softmax(s * head["base"], -1))
        a[f"chain_full@{s}"] = overlap(p, jax.nn.softmax(s * head["full"], -1))
    for c in CANDIDATES:
        a.update(chain_alphas(p, head, c, mixtures=c == CANDIDATES[0]))
    flash_cands = top_k_indices(flash_logits, CANDIDATES[0])
    a[f"mass.C{CANDIDATES[0]}.dflash"] = jnp.sum(jnp.take_along_axis(p, flash_cands, -1), -1)
    return {k: np.asarray(v) for k, v in a.items()}


def t0_alphas(greedy, flash_logits, head: dict) -> dict:
    """alpha_i = [argmax q_i == the target's greedy token] [n, S], and top-C coverage."""
    a = {"dflash.marginal": jnp.argmax(flash_logits, -1) == greedy,
         "dspine.marginal": jnp.argmax(head["base"], -1) == greedy,
         "chain_full": jnp.argmax(head["full"], -1) == greedy}
    for c in CANDIDATES:
        cands, scores, _ = top_c(head, c)
        pick = jnp.take_along_axis(cands, jnp.argmax(scores, -1)[..., None], -1)[..., 0]
        a[f"chain.C{c}"] = pick == greedy
        a[f"coverage.C{c}.dspine"] = jnp.any(cands == greedy[..., None], -1)
    return {k: np.asarray(v, np.float32) for k, v in a.items()}


def sequence_alphas(model, flash, spine, tokens: np.ndarray, prompt_len: int, stride: int,
                    greedy_context: bool) -> dict | None:
    """All alphas of one sequence's blocks; None if it is too short for a block."""
    k = spine.config.block_size
    s = k - 1
    anchors = np.arange(prompt_len, len(tokens) - k + 1, stride, dtype=np.int32)
    if len(anchors) == 0:
        return None
    e_out = model.output_embedding()
    feats, probs = target_pass(model, tokens, spine.config.target_layer_ids)
    p = at_slots(probs, anchors, s)                                      # [n, S, V]
    labels = jnp.asarray(tokens[anchors[:, None] + 1 + np.arange(s)])    # [n, S]
    flash_logits = drafter_pass(model, flash, tokens, feats, anchors).logits[0, :, 1:]
    out = drafter_pass(model, spine, tokens, feats, anchors)
    head = chain_given_truth(spine, out, jnp.asarray(tokens[anchors]), labels, e_out,
                             max(CANDIDATES))
    res = {"t1": t1_alphas(p, flash_logits, head)}
    if greedy_context:
        greedy = jnp.argmax(p, -1)       # the target's greedy token given the true prefix
        res["t0"] = t0_alphas(greedy, flash_logits, head)
        engine = chain_tokens(spine, out, tokens[anchors], e_out)       # the walk, T=0
        res["t0_engine_rule"] = accepted(engine, np.asarray(greedy))
    return res


# ----- summaries -----------------------------------------------------------------------------
def summarise(alphas: dict) -> dict:
    """name -> {E: mean over blocks of 1 + sum_k prod alpha, alpha per slot, mean alpha}."""
    out = {}
    for name, a in alphas.items():
        out[name] = {"E_tokens": float(np.mean(expected_tokens(a))),
                     "alpha_mean": float(a.mean()), "alpha_per_slot": a.mean(0).tolist()}
    return out


def merge(per_seq: list[dict], key: str) -> dict:
    return {name: np.concatenate([r[key][name] for r in per_seq])
            for name in per_seq[0][key]}


def context_report(per_seq: list[dict]) -> dict:
    t1 = merge(per_seq, "t1")
    rates = {c: t1.pop(f"pred_in.C{c}") > 0.5 for c in CANDIDATES}       # [N, S] bool
    pred_in, chain = rates[CANDIDATES[0]], t1[f"chain.C{CANDIDATES[0]}@1.0"]
    report = {"blocks": int(len(pred_in)), "t1": summarise(t1),
              # slots 2..S whose true predecessor is not among the previous slot's C
              "pred_not_candidate": {str(c): float(1 - r[:, 1:].mean())
                                     for c, r in rates.items()},
              "pred_not_candidate_per_slot.C16": (1 - pred_in.mean(0)).tolist(),
              "chain.C16@1.0_alpha_pred_in": float(chain[pred_in].mean()),
              "chain.C16@1.0_alpha_pred_out": float(chain[~pred_in].mean())
              if (~pred_in).any() else None}
    if "t0" in per_seq[0]:
        report["t0"] = summarise(merge(per_seq, "t0"))
        engine = np.concatenate([r["t0_engine_rule"] for r in per_seq])
        report["t0_engine_rule_tau"] = float(engine.mean())
    return report


def best(rep: dict, prefix: str, suffix: str = "") -> str:
    """The name of the variant with the highest E among `prefix<s>suffix`, s in SCALES."""
    return max((f"{prefix}{s}{suffix}" for s in SCALES), key=lambda n: rep[n]["E_tokens"])


def best_mix(rep: dict, c: int) -> str:
    return max((f"chain.C{c}@{s}+mix={w}" for s in SCALES for w in MIX_WEIGHTS),
               key=lambda n: rep[n]["E_tokens"])


def table(report: dict) -> str:
    """The headline rows: E[tokens] at T=1 (sampled and greedy contexts), alpha_1, mean
    alpha, and the T=0 analogue; then the candidate count C."""
    sampled, greedy = report["sampled"]["t1"], report["greedy"]["t1"]
    t0 = report["greedy"]["t0"]
    rows = [("DFlash marginal", "dflash.marginal@1.0", "dflash.marginal"),
            ("DFlash marginal, best s", best(sampled, "dflash.marginal@"), None),
            ("DSpine marginal (base head)", "dspine.marginal@1.0", "dspine.marginal"),
            ("DSpine marginal, best s", best(sampled, "dspine.marginal@"), None),
            ("DSpine chain C=16 (the engine's q)", "chain.C16@1.0", "chain.C16"),
            ("DSpine chain C=16, best s", best(sampled, "chain.C16@"), None),
            ("chain C=16 + marginal tail", "chain.C16@1.0+tail", None),
            ("chain C=16 + marginal tail, best s", best(sampled, "chain.C16@", "+tail"), None),
            ("chain C16 + marginal@1 tail, best s", best(sampled, "chain.C16@", "+tail1"),
             None),
            ("chain C=16 + w marginal, best", best_mix(sampled, 16), None),
            ("DSpine chain, full vocab", "chain_full@1.0", "chain_full"),
            ("DSpine chain, full vocab, best s", best(sampled, "chain_full@"), None),
            ("bound: p mass on DSpine's C=16", "mass.C16.dspine", "coverage.C16.dspine"),
            ("bound: p mass on DFlash's top-16", "mass.C16.dflash", None)]
    flash = sampled["dflash.marginal@1.0"]["E_tokens"]
    lines = [f"{'q':35s} {'variant':22s} {'E T=1':>6s} {'/DFl':>5s} {'a_1':>5s} {'a_mean':>6s}"
             f" {'E T=1 greedy ctx':>16s} {'E T=0':>6s}"]
    for label, name, t0_name in rows:
        r, g = sampled[name], greedy[name]
        e0 = f"{t0[t0_name]['E_tokens']:6.3f}" if t0_name else f"{'':6s}"
        lines.append(f"{label:35s} {name:22s} {r['E_tokens']:6.3f} {r['E_tokens'] / flash:5.3f}"
                     f" {r['alpha_per_slot'][0]:5.3f} {r['alpha_mean']:6.3f}"
                     f" {g['E_tokens']:16.3f} {e0}")
    lines.append("")
    lines.append(f"{'C':>4s} {'chain@1':>8s} {'best s':>14s} {'+tail@1':>8s} {'+tail best s':>14s}"
                 f" {'mass':>6s} {'pred out':>8s} {'E T=0':>6s} {'cover T=0':>9s}")
    for c in CANDIDATES:
        bs, bt = best(sampled, f"chain.C{c}@"), best(sampled, f"chain.C{c}@", "+tail")
        lines.append(
            f"{c:4d} {sampled[f'chain.C{c}@1.0']['E_tokens']:8.3f}"
            f" {sampled[bs]['E_tokens']:6.3f} s={bs.split('@')[1]:5s}"
            f" {sampled[f'chain.C{c}@1.0+tail']['E_tokens']:8.3f}"
            f" {sampled[bt]['E_tokens']:6.3f} s={bt.split('@')[1].split('+')[0]:5s}"
            f" {sampled[f'mass.C{c}.dspine']['alpha_mean']:6.3f}"
            f" {report['sampled']['pred_not_candidate'][str(c)]:8.3f}"
            f" {t0[f'chain.C{c}']['E_tokens']:6.3f}"
            f" {t0[f'coverage.C{c}.dspine']['alpha_mean']:9.3f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_heldout_args(parser)
    parser.add_argument("--dflash", default="smollm2-135m-instruct-dflash")
    parser.add_argument("--dspine", default="smollm2-135m-instruct-dspine")
    parser.add_argument("--stride", type=int, default=8, help="anchor every N tokens")
    parser.add_argument("--seed", type=int, default=0, help="of the T=1 continuations")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    start = time.time()
    loaded = load_target(args.target, dtype=args.dtype)
    model = loaded.model
    ar = Pipeline.from_loaded(loaded)
    prompts = heldout_prompts(ar, args.prompts, args.max_prompt_tokens)
    flash = load_drafter(resolve_drafter(args.dflash), dtype=model.dtype)
    spine = load_drafter(resolve_drafter(args.dspine), dtype=model.dtype)
    report = {"settings": vars(args) | {"out": str(args.out)}}
    for context, temperature in (("sampled", 1.0), ("greedy", 0.0)):
        seqs = continuations(ar, prompts, args.max_new_tokens, temperature, args.seed)
        per_seq = [sequence_alphas(model, flash, spine, t, n, args.stride, temperature == 0)
                   for t, n in seqs]
        report[context] = context_report([r for r in per_seq if r is not None])
        print(f"{context}: {report[context]['blocks']} blocks, "
              f"{time.time() - start:.0f} s", flush=True)
    report["seconds"] = time.time() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "t1_acceptance.json").write_text(json.dumps(report, indent=1))
    print(table(report))
    for context in ("sampled", "greedy"):
        rep = report[context]
        print(f"{context}: true predecessor not among the previous slot's 16 candidates at "
              f"{rep['pred_not_candidate']['16']:.3f} of slots 2..S; chain alpha there "
              f"{rep['chain.C16@1.0_alpha_pred_out']:.3f}, elsewhere "
              f"{rep['chain.C16@1.0_alpha_pred_in']:.3f}")
    print("T=0 engine-rule tau (the engine's greedy walk, C=16):",
          report["greedy"]["t0_engine_rule_tau"])


if __name__ == "__main__":
    main()
