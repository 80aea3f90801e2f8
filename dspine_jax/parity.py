"""Cross-framework parity: the same drafter and target run in JAX and in PyTorch
(`dspine_torch`), compared stage by stage.

A *stage record* is a flat dict of numpy arrays for one prompt (batch of one), the same
keys on both sides (`dspine_torch/stages.py` writes the PyTorch one):

  features        [T, F]        target features over the prompt
  first_token     []            the target's greedy token after the prompt (the anchor)
  draft_logits    [K, V]        the drafter's base logits of the first block
  draft_tokens    [K-1]         the T = 0 proposal
  q               [K-1, V]      DFlash: the warped slot softmax at temperature q_temperature
                  [K-1, C, C]   DSpine: softmax over the candidates given each predecessor
  target_logits   [K, V]        the target's logits over [anchor, drafts]
  num_accepted    []            drafts the first T = 0 verify keeps
  tokens          [N]           T = 0 speculative decoding (ignore EOS)
  accept_lengths  [steps]       tokens emitted per verify pass
DSpine adds gates [L] (mean gate per layer), candidates [K-1, C], transition [K-1, C, C].

Golden fixtures (tests/fixtures/torch_port/) are records the JAX side wrote; the PyTorch
tests read them without running JAX, and a JAX test regenerates them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dspine_jax.drafters.model import BlockDrafter
from dspine_jax.engine import SpeculativeEngine
from dspine_jax.sampling import SamplingParams, top_k_indices, warp_logits
from dspine_jax.speculative.propose import propose
from dspine_jax.target import TargetModel

# Stated tolerances (max abs difference) per stage in float32; exact stages (token ids,
# accepted lengths) must match exactly.
TOLERANCES = {
    "float32": {"features": 1e-4, "draft_logits": 1e-4, "q": 1e-5, "target_logits": 1e-4,
                "gates": 1e-5, "transition": 1e-4},
}
# bf16 is not given hand-set numbers. `run_parity --dtype bf16` also runs the float32 pair
# on the same prompts and takes, per stage, its max abs difference as the noise floor of
# the two implementations (different operation orders, different kernels). To first order
# rounding error grows with the unit roundoff, so the bf16 tolerance of a stage is that
# floor times u_bf16 / u_f32 = 2^-8 / 2^-24 = 2^16 (floored at one f32 ulp of the stage's
# scale, so a floor of exactly 0 still leaves bf16 room). Differences in *where* the two
# sides round (transformers casts RoPE's cos/sin to bf16; JAX keeps them in float32) are
# not operation-order noise: a stage that fails by that is reported, not re-tuned.
BF16_OVER_F32 = 2.0 ** 16
F32_ULP = 2.0 ** -23
EXACT = ("first_token", "draft_tokens", "candidates", "num_accepted", "tokens",
         "accept_lengths")


def jax_stages(target: TargetModel, drafter: BlockDrafter, prompt: list[int], *,
               max_new_tokens: int = 16, q_temperature: float = 0.8) -> dict[str, np.ndarray]:
    """The stage record of one prompt (see the module docstring)."""
    config = drafter.config
    tokens = jnp.asarray([prompt], jnp.int32)
    e_in, e_out = target.input_embedding(), target.output_embedding()
    out = target(tokens, hidden_layer_ids=config.target_layer_ids)
    features = out.features()                                          # [1, T, F]
    first = jnp.argmax(out.logits[:, -1], -1).astype(jnp.int32)        # [1]
    context = drafter.create_context(1, len(prompt) + config.block_size)
    context = drafter.extend_context(context, features, jnp.asarray([len(prompt)]))
    draft = drafter.draft_block(first, context, e_in, e_out)
    greedy = SamplingParams.create(1)
    proposal = propose(drafter, draft, first, e_out, greedy, jax.random.key(0))
    record = {"features": features[0], "first_token": first[0], "draft_logits":
              draft.logits[0, 0], "draft_tokens": proposal.tokens[0]}
    warm = SamplingParams.create(1, temperature=q_temperature)
    chain = config.dspine is not None and config.dspine.refinement_head
    if chain:
        base = draft.logits[:, 0, 1:]                                  # [1, K-1, V]
        c = min(config.dspine.top_k, config.vocab_size)
        candidates = top_k_indices(base, c)
        preds = jnp.concatenate([jnp.broadcast_to(first[:, None, None], (1, 1, c)),
                                 candidates[:, :-1]], 1)
        table = drafter.transition_scores(draft.pre_injection[:, 0, 1:], preds,
                                          jnp.take(e_out, candidates, axis=0), e_out)
        record["candidates"] = candidates[0]
        record["transition"] = table[0]
        record["q"] = jax.nn.softmax(warp_logits(table, warm), -1)[0]
    else:
        record["q"] = jax.nn.softmax(warp_logits(draft.logits[:, 0, 1:], warm), -1)[0]
    if draft.gates is not None:
        record["gates"] = draft.gates
    block = jnp.concatenate([tokens, first[:, None], proposal.tokens], 1)
    target_logits = target(block).logits[0, len(prompt):]              # [K, V]
    record["target_logits"] = target_logits
    matches = np.asarray(proposal.tokens[0]) == np.asarray(jnp.argmax(target_logits[:-1], -1))
    record["num_accepted"] = np.int32(np.cumprod(matches).sum())
    engine = SpeculativeEngine(target, drafter, steps_per_call=4)
    [gen] = engine.generate([prompt], max_new_tokens=max_new_tokens, ignore_eos=True).generations
    record["tokens"] = np.asarray(gen.tokens, np.int32)
    record["accept_lengths"] = np.asarray(gen.accept_lengths, np.int32)
    return {k: np.asarray(v) for k, v in record.items()}


@dataclasses.dataclass
class StageDiff:
    stage: str
    value: float          # max abs difference, or mismatching entries for exact stages
    tolerance: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.value <= self.tolerance


def compare(ours: dict, theirs: dict, dtype: str = "float32",
            floor: dict | None = None) -> list[StageDiff]:
    """Stage by stage: max abs difference within tolerance, exact stages equal, plus the
    argmax agreement of the draft logits (slots 1..K-1). float32 uses TOLERANCES; bf16
    needs `floor` (stage -> the float32 pair's max abs difference, see BF16_OVER_F32)."""
    if dtype == "bfloat16":
        if floor is None:
            raise ValueError("bf16 tolerances derive from the float32 pair's noise floor")
        tolerances = None
    else:
        tolerances = TOLERANCES[dtype]
    rows = []
    missing = sorted(set(ours) ^ set(theirs))
    if missing:
        rows.append(StageDiff("keys", len(missing), 0, f"only on one side: {missing}"))
    for name in ours:
        if name not in theirs:
            continue
        a, b = np.asarray(ours[name]), np.asarray(theirs[name])
        if name in EXACT:
            if a.shape != b.shape:
                rows.append(StageDiff(name, max(a.size, b.size), 0,
                                      f"{a.tolist()} vs {b.tolist()}"))
            else:
                bad = int(np.sum(a != b))
                rows.append(StageDiff(name, bad, 0, "" if not bad else
                                      f"{a.tolist()} vs {b.tolist()}"))
        elif a.shape != b.shape:
            rows.append(StageDiff(name, float("inf"), 0.0, f"shapes {a.shape} vs {b.shape}"))
        else:
            diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
            scale = float(np.max(np.abs(a)))
            if dtype == "bfloat16":
                base = max(floor.get(name, 0.0), F32_ULP * scale)
                tolerance = base * BF16_OVER_F32
            else:
                tolerance = tolerances[name]
            if (dtype == "bfloat16" and name in ("q", "transition")
                    and not np.array_equal(ours.get("candidates"), theirs.get("candidates"))):
                tolerance = float("inf")  # different candidates: rows are not comparable
            if (dtype == "bfloat16" and name == "target_logits"
                    and not np.array_equal(ours.get("draft_tokens"), theirs.get("draft_tokens"))):
                tolerance = float("inf")  # the target scored different drafts
            rows.append(StageDiff(name, diff, tolerance, f"max |value| {scale:.3g}"))
    if "draft_logits" in ours and "draft_logits" in theirs:
        a, b = ours["draft_logits"][1:], theirs["draft_logits"][1:]
        if a.shape == b.shape:
            same = np.argmax(a, -1) == np.argmax(b, -1)
            rows.append(StageDiff("draft_argmax_disagreement", 1 - float(np.mean(same)), 0,
                                  f"argmax agreement {np.mean(same):.1%}, per slot "
                                  + "".join("=" if x else "x" for x in same)))
    if "tokens" in ours and "tokens" in theirs:
        agree = token_agreement(ours["tokens"], theirs["tokens"])
        rows.append(StageDiff("token_disagreement", 1 - agree["rate"], 0,
                              f"T=0 tokens agree {agree['rate']:.1%}, first divergence at "
                              f"{agree['first_divergence']}"))
    return rows


def token_agreement(a, b) -> dict:
    """Position-by-position agreement of two T = 0 token streams, and the first position
    where they part (None if never): after it, each side continues its own text."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    same = a[:n] == b[:n]
    first = int(np.argmin(same)) if not same.all() else None
    return {"rate": float(same.mean()) if n else 1.0, "first_divergence": first}


def noise_floor(ours: dict, theirs: dict) -> dict:
    """Per float stage, the max abs difference of two records (the float32 pair)."""
    out = {}
    for name, a in ours.items():
        b = theirs.get(name)
        if name in EXACT or b is None or np.shape(a) != np.shape(b):
            continue
        out[name] = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
    return out


DEFAULT_TEXTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, there")


def read_prompts(path, tokenizer, vocab_size: int) -> list[list[int]]:
    """JSONL, one {"prompt": text} (needs the target's tokenizer) or {"token_ids": [...]}
    per line; without a file, three fixed texts (or fixed ids for a target without a
    tokenizer)."""
    from dspine_jax.data.prompts import read_jsonl
    from dspine_jax.errors import InputError

    if path is None:
        if tokenizer is None:
            rng = np.random.default_rng(0)
            return [rng.integers(0, vocab_size, n).tolist() for n in (7, 12, 20)]
        return [tokenizer.encode(t) for t in DEFAULT_TEXTS]
    prompts = []
    for n, row in read_jsonl(path):
        if not isinstance(row, dict):
            raise InputError(f"{path}:{n}: expected a JSON object")
        if "token_ids" in row:
            ids = [int(i) for i in row["token_ids"]]
        elif "prompt" in row and tokenizer is not None:
            ids = tokenizer.encode(row["prompt"])
        else:
            raise InputError(f"{path}:{n}: give \"token_ids\", or \"prompt\" with a target "
                             "that has a tokenizer")
        if not ids or not all(0 <= i < vocab_size for i in ids):
            raise InputError(f"{path}:{n}: empty prompt or token ids outside [0, {vocab_size})")
        prompts.append(ids)
    if not prompts:
        raise InputError(f"{path}: no prompts")
    return prompts


def run_parity(target: str, drafter: str, *, prompts_file=None, temperature: float = 0.8,
               max_new_tokens: int = 32, dtype: str = "f32"):
    """Load the same target and drafter in JAX and in PyTorch (transformers + dspine_torch)
    and compare every prompt's stage records. Returns (per-prompt rows, all within
    tolerance)."""
    from pathlib import Path

    from dspine_jax.checkpoints import load_target, resolve_dtype
    from dspine_jax.drafters.checkpoint import load_drafter
    from dspine_jax.errors import CheckpointError, ConfigError, InputError
    from dspine_jax.registry import resolve_drafter, resolve_target

    if dtype not in ("f32", "bf16"):
        raise InputError(f"--dtype must be f32 or bf16, got {dtype!r}")
    if not temperature > 0:
        raise InputError(f"--temperature must be > 0 (the q stage's temperature; tokens are "
                         f"always compared at T = 0), got {temperature!r}")
    try:
        import torch
        import transformers

        import dspine_torch
        from dspine_torch.stages import torch_stages
    except ImportError as e:
        raise ConfigError(f"parity needs PyTorch and transformers ({e}); install the "
                          "test extra: pip install 'dspine-jax[test]'") from e
    target_path = Path(resolve_target(target))
    if not target_path.is_dir():
        raise CheckpointError(f"{target_path}: parity needs an HF checkpoint folder (the "
                              "PyTorch side loads it with transformers)")
    drafter_path = resolve_drafter(drafter)
    jdtype = resolve_dtype(dtype)
    tdtype = torch.float32 if dtype == "f32" else torch.bfloat16
    loaded = load_target(str(target_path), dtype=dtype,
                         with_tokenizer=(target_path / "tokenizer.json").is_file())
    jax_drafter = load_drafter(drafter_path, dtype=jdtype)
    jax_drafter.config.check_target(loaded.config)
    torch_target = transformers.AutoModelForCausalLM.from_pretrained(
        target_path, dtype=tdtype).eval()
    torch_drafter = dspine_torch.load_drafter(drafter_path, dtype=tdtype)
    prompts = read_prompts(prompts_file, loaded.tokenizer, loaded.config.vocab_size)
    name = "float32" if dtype == "f32" else "bfloat16"
    f32_pair = None
    if name == "bfloat16":  # the noise floor the bf16 tolerances scale from
        f32_target = load_target(str(target_path), dtype="f32", with_tokenizer=False).model
        f32_pair = (f32_target, load_drafter(drafter_path, dtype=resolve_dtype("f32")),
                    transformers.AutoModelForCausalLM.from_pretrained(
                        target_path, dtype=torch.float32).eval(),
                    dspine_torch.load_drafter(drafter_path, dtype=torch.float32))
    results, ok = [], True
    for prompt in prompts:
        ours = jax_stages(loaded.model, jax_drafter, prompt, max_new_tokens=max_new_tokens,
                          q_temperature=temperature)
        theirs = torch_stages(torch_target, torch_drafter, prompt,
                              max_new_tokens=max_new_tokens, q_temperature=temperature)
        floor = None
        if f32_pair is not None:
            floor = noise_floor(
                jax_stages(f32_pair[0], f32_pair[1], prompt, max_new_tokens=max_new_tokens,
                           q_temperature=temperature),
                torch_stages(f32_pair[2], f32_pair[3], prompt, max_new_tokens=max_new_tokens,
                             q_temperature=temperature))
        rows = compare(ours, theirs, name, floor)
        if name == "bfloat16":  # rounding flips near-ties: token stages are reported only
            rows = [dataclasses.replace(r, tolerance=float("inf")) if r.stage in EXACT
                    or r.stage in ("draft_argmax_disagreement", "token_disagreement") else r
                    for r in rows]
        ok &= all(r.ok for r in rows)
        results.append((prompt, rows))
    return results, ok


def format_report(results, ok: bool) -> str:
    lines = []
    for i, (prompt, rows) in enumerate(results):
        lines.append(f"prompt {i} ({len(prompt)} tokens)")
        for r in rows:
            value = f"{r.value:.3g}" if isinstance(r.value, float) else str(r.value)
            tol = "report only" if r.tolerance == float("inf") else f"<= {r.tolerance:g}"
            lines.append(f"  {r.stage:27s} {value:>10s}  {tol:12s} "
                         f"{'ok' if r.ok else 'FAIL'}  {r.detail[:70]}")
    lines.append("parity: " + ("all stages within tolerance" if ok else "FAILED"))
    return "\n".join(lines)
