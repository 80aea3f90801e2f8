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
from dspine_jax.runtime.offline import generate_tokens
from dspine_jax.sampling import SamplingParams, top_k_indices, warp_logits
from dspine_jax.speculative.propose import propose
from dspine_jax.target import TargetModel

# Stated tolerances (max abs difference) per stage in float32, for values of order 1, and
# never below F32_RELATIVE of the stage's largest magnitude: float32 rounding grows with
# the values, and a real model's outlier activations carry it through every layer
# (SmolLM2's hidden features reach 2.5e4, where one ulp is 0.002). q is a softmax of the
# drafter's scores at temperature T, so scores that differ by d move q by at most
# exp(2d / T) - 1 (about 2d / T): its tolerance is never below what the measured score
# difference implies. Exact stages (token ids, accepted lengths) must match exactly.
TOLERANCES = {
    "float32": {"features": 1e-4, "draft_logits": 1e-4, "q": 1e-5, "target_logits": 1e-4,
                "gates": 1e-5, "transition": 1e-4},
}
F32_RELATIVE = 1e-5
# bf16 gets no hand-set numbers. `run_parity --dtype bf16` runs every prompt four times:
# JAX and PyTorch, each in bf16 and in float32 on the same weights. A stage's *noise
# floor* on one side is the distance between that side's bf16 and float32 records: what
# bf16 rounding alone does to it there (transformers, for one, rounds RoPE's cos/sin to
# bf16 and JAX does not, so the two floors can differ a lot). The bf16 pair passes a
# stage when
#     d(JAX bf16, torch bf16) <= floor_jax + floor_torch + the stage's float32 tolerance,
# the triangle inequality through the two float32 runs: rounding on both sides plus the
# float32 parity already asked for explains the whole difference. A difference of the
# implementations (a weight, a cast, a mask) is in neither floor and fails when it is
# larger than that rounding. Distances: max abs difference for float stages, the count
# of differing entries for exact stages (token ids, accepted lengths), the disagreeing
# fraction for the argmax and token agreement rows; each obeys the triangle inequality,
# so tokens that flip on a near-tie in bf16 are judged by the same rule.
EXACT = ("first_token", "draft_tokens", "candidates", "num_accepted", "tokens",
         "accept_lengths")
AGREEMENT = ("draft_argmax_disagreement", "token_disagreement")


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
    [gen] = generate_tokens(engine, [prompt], max_new_tokens=max_new_tokens,
                            ignore_eos=True).generations
    record["tokens"] = np.asarray(gen.tokens, np.int32)
    record["accept_lengths"] = np.asarray(gen.accept_lengths, np.int32)
    return {k: np.asarray(v) for k, v in record.items()}


@dataclasses.dataclass
class StageDiff:
    stage: str
    value: float          # the stage's distance (see EXACT and AGREEMENT)
    tolerance: float
    detail: str = ""
    floors: tuple | None = None   # bf16: (JAX bf16 vs f32, torch bf16 vs f32)

    @property
    def ok(self) -> bool:
        return self.value <= self.tolerance


def _padded_mismatches(a: np.ndarray, b: np.ndarray) -> int:
    """Entries that differ, a missing entry differing from anything (a Hamming distance
    over sequences of any length)."""
    a, b = a.reshape(-1), b.reshape(-1)
    n = min(len(a), len(b))
    return int(np.sum(a[:n] != b[:n])) + abs(len(a) - len(b))


def in_id_order(record: dict) -> dict:
    """A DSpine record with each slot's candidates in id order, and the transition scores
    and q [K-1, C, C] permuted to match (rows: the previous slot's candidates, slot 0's
    rows all the anchor; columns: the slot's own). The candidates are the top-C set of the
    draft logits, whose order two near-equal logits may swap between frameworks; what is
    drafted (draft_tokens, tokens) is compared as it is."""
    if "candidates" not in record:
        return record
    candidates = np.asarray(record["candidates"])                     # [S, C]
    s, c = candidates.shape
    order = np.argsort(candidates, -1, kind="stable")
    rows = np.concatenate([np.arange(c)[None], order[:-1]], 0)        # [S, C]
    out = dict(record, candidates=np.take_along_axis(candidates, order, -1))
    for name in ("transition", "q"):
        table = np.asarray(record.get(name, ()))
        if table.shape == (s, c, c):
            table = np.take_along_axis(table, order[:, None, :], -1)
            out[name] = np.take_along_axis(table, rows[:, :, None], 1)
    return out


def distances(ours: dict, theirs: dict) -> dict[str, float]:
    """Per stage present on both sides, the distance of two stage records: max abs
    difference (float stages; inf for different shapes), differing entries (EXACT; each
    slot's candidates as a set, see `in_id_order`), the disagreeing fraction of
    drafted-slot argmaxes and of T = 0 tokens (AGREEMENT)."""
    ours, theirs = in_id_order(ours), in_id_order(theirs)
    out = {}
    for name, a in ours.items():
        if name not in theirs:
            continue
        a, b = np.asarray(a), np.asarray(theirs[name])
        if name in EXACT:
            out[name] = float(_padded_mismatches(a, b))
        elif a.shape != b.shape:
            out[name] = float("inf")
        else:
            out[name] = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)),
                                     initial=0.0))
    if "draft_logits" in ours and "draft_logits" in theirs:
        a, b = np.asarray(ours["draft_logits"])[1:], np.asarray(theirs["draft_logits"])[1:]
        out["draft_argmax_disagreement"] = (
            float(np.mean(np.argmax(a, -1) != np.argmax(b, -1))) if a.shape == b.shape
            else 1.0)
    if "tokens" in ours and "tokens" in theirs:
        a, b = np.asarray(ours["tokens"]), np.asarray(theirs["tokens"])
        out["token_disagreement"] = _padded_mismatches(a, b) / max(1, len(a), len(b))
    return out


def compare(ours: dict, theirs: dict, dtype: str = "float32",
            floors: tuple[dict, dict] | None = None,
            q_temperature: float | None = None) -> list[StageDiff]:
    """Stage by stage: each distance (see `distances`) within its tolerance. float32:
    TOLERANCES for float stages (at least F32_RELATIVE of the stage's largest value), 0
    for the others. bfloat16 needs `floors`: the
    distances of each side's bf16 record from its own float32 record (JAX's, torch's);
    a stage's tolerance is their sum plus its float32 tolerance (see the note above)."""
    if dtype == "bfloat16" and floors is None:
        raise ValueError("bf16 tolerances come from the noise floors: each side's bf16 "
                         "record against its own float32 record")
    f32 = TOLERANCES["float32"]
    rows = []
    missing = sorted(set(ours) ^ set(theirs))
    if missing:
        rows.append(StageDiff("keys", len(missing), 0, f"only on one side: {missing}"))
    measured = distances(ours, theirs)
    for name, value in measured.items():
        exact = name in EXACT or name in AGREEMENT
        scale = 0.0 if exact else float(np.max(np.abs(np.asarray(ours[name], np.float64)),
                                               initial=0.0))
        tolerance = 0.0 if exact else max(f32[name], F32_RELATIVE * scale)
        if name == "q" and q_temperature:
            scores = max(measured.get("draft_logits", 0.0), measured.get("transition", 0.0))
            tolerance = max(tolerance, float(np.expm1(2 * scores / q_temperature)))
        pair = None
        if floors is not None:
            pair = (floors[0].get(name, 0.0), floors[1].get(name, 0.0))   # none: no room
            tolerance = pair[0] + pair[1] + tolerance
        rows.append(StageDiff(name, int(value) if name in EXACT else value, tolerance,
                              _detail(name, ours, theirs, value), pair))
    return rows


def _detail(name, ours, theirs, value) -> str:
    if name == "draft_argmax_disagreement":
        a, b = np.asarray(ours["draft_logits"])[1:], np.asarray(theirs["draft_logits"])[1:]
        same = np.argmax(a, -1) == np.argmax(b, -1) if a.shape == b.shape else []
        return (f"argmax agreement {1 - value:.1%}, per slot "
                + "".join("=" if x else "x" for x in same))
    if name == "token_disagreement":
        agree = token_agreement(ours["tokens"], theirs["tokens"])
        return (f"T=0 tokens agree {agree['rate']:.1%}, first divergence at "
                f"{agree['first_divergence']}")
    a, b = np.asarray(ours[name]), np.asarray(theirs[name])
    if name in EXACT:
        return "" if not value else f"{a.tolist()} vs {b.tolist()}"
    if a.shape != b.shape:
        return f"shapes {a.shape} vs {b.shape}"
    return f"max |value| {float(np.max(np.abs(a), initial=0.0)):.3g}"


def token_agreement(a, b) -> dict:
    """Position-by-position agreement of two T = 0 token streams, and the first position
    where they part (None if never): after it, each side continues its own text."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    same = a[:n] == b[:n]
    first = int(np.argmin(same)) if not same.all() else None
    return {"rate": float(same.mean()) if n else 1.0, "first_divergence": first}


def judge_bf16(jax_bf16: dict, torch_bf16: dict, jax_f32: dict, torch_f32: dict,
               q_temperature: float | None = None) -> tuple[list[StageDiff], list[StageDiff]]:
    """The bf16 pair judged against the two noise floors, and the float32 pair of the
    same prompt judged by TOLERANCES (the floors' triangle goes through it)."""
    floors = (distances(jax_bf16, jax_f32), distances(torch_bf16, torch_f32))
    return (compare(jax_bf16, torch_bf16, "bfloat16", floors),
            compare(jax_f32, torch_f32, "float32", q_temperature=q_temperature))


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
                          "torch extra: pip install 'dspine-jax[torch]'") from e
    target_path = Path(resolve_target(target))
    gguf = target_path.is_file() and target_path.suffix == ".gguf"
    if not (target_path.is_dir() or gguf):
        raise CheckpointError(f"{target_path}: parity needs an HF checkpoint folder or a "
                              ".gguf file (the PyTorch side loads it with transformers)")
    drafter_path = resolve_drafter(drafter)
    jdtype = resolve_dtype(dtype)
    tdtype = torch.float32 if dtype == "f32" else torch.bfloat16

    def torch_target_in(torch_dtype):
        """transformers' own load of the same file: a GGUF is dequantized by transformers
        (which undoes llama.cpp's Q/K row permutation, as our loader does)."""
        where = ({"pretrained_model_name_or_path": target_path.parent,
                  "gguf_file": target_path.name} if gguf
                 else {"pretrained_model_name_or_path": target_path})
        return transformers.AutoModelForCausalLM.from_pretrained(
            **where, dtype=torch_dtype).eval()

    loaded = load_target(str(target_path), dtype=dtype,
                         with_tokenizer=gguf or (target_path / "tokenizer.json").is_file())
    jax_drafter = load_drafter(drafter_path, dtype=jdtype)
    jax_drafter.config.check_target(loaded.config)
    torch_target = torch_target_in(tdtype)
    torch_drafter = dspine_torch.load_drafter(drafter_path, dtype=tdtype)
    prompts = read_prompts(prompts_file, loaded.tokenizer, loaded.config.vocab_size)
    f32_pair = None
    if dtype == "bf16":  # each side's float32 run: its noise floor and the f32 pair
        f32_pair = (load_target(str(target_path), dtype="f32", with_tokenizer=False).model,
                    load_drafter(drafter_path, dtype=resolve_dtype("f32")),
                    torch_target_in(torch.float32),
                    dspine_torch.load_drafter(drafter_path, dtype=torch.float32))
    results, ok = [], True
    kw = {"max_new_tokens": max_new_tokens, "q_temperature": temperature}
    for prompt in prompts:
        ours = jax_stages(loaded.model, jax_drafter, prompt, **kw)
        theirs = torch_stages(torch_target, torch_drafter, prompt, **kw)
        if f32_pair is None:
            rows = compare(ours, theirs, "float32", q_temperature=temperature)
        else:
            rows, f32_rows = judge_bf16(ours, theirs,
                                        jax_stages(f32_pair[0], f32_pair[1], prompt, **kw),
                                        torch_stages(f32_pair[2], f32_pair[3], prompt, **kw),
                                        q_temperature=temperature)
            bad = [r.stage for r in f32_rows if not r.ok]
            rows.append(StageDiff("float32_pair_failures", len(bad), 0,
                                  "float32 pair within tolerance" if not bad else
                                  f"float32 pair out of tolerance: {bad}"))
        ok &= all(r.ok for r in rows)
        results.append((prompt, rows))
    return results, ok


def format_report(results, ok: bool) -> str:
    """One table per prompt: stage, distance, tolerance, verdict, and in bf16 the two
    noise floors (each side's bf16 against its own float32) the tolerance sums."""
    lines = []
    for i, (prompt, rows) in enumerate(results):
        lines.append(f"prompt {i} ({len(prompt)} tokens)")
        bf16 = any(r.floors is not None for r in rows)
        if bf16:
            lines.append(f"  {'stage':27s} {'bf16 diff':>10s}  {'tolerance':12s} {'':4s}  "
                         f"{'floor jax':>10s} {'floor torch':>11s}  detail")
        for r in rows:
            value = f"{r.value:.3g}" if isinstance(r.value, float) else str(r.value)
            tol = "report only" if r.tolerance == float("inf") else f"<= {r.tolerance:.3g}"
            floors = ""
            if bf16:
                floors = ("" if r.floors is None else
                          f"{r.floors[0]:10.3g} {r.floors[1]:11.3g}").ljust(22) + "  "
            lines.append(f"  {r.stage:27s} {value:>10s}  {tol:12s} "
                         f"{'ok' if r.ok else 'FAIL':4s}  {floors}{r.detail[:70]}")
    lines.append("parity: " + ("all stages within tolerance" if ok else "FAILED"))
    return "\n".join(lines)
