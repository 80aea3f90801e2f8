"""Time the JAX/Pallas side of DSpine's decoding kernels on the shapes, ops and byte counts
of benchmarks/torch_kernels.py, so that the two JSON files read side by side.

    python -m dspine_benchmarks.jax_kernels --out jax_kernels.json      # CUDA
    python -m dspine_benchmarks.jax_kernels --quick --out quick.json    # < 60 s
    python -m dspine_benchmarks.jax_kernels --device cpu                # smoke

Every row is printed (flushed) as it is measured and, with --out, the JSON file is
rewritten after every row, so a run cut short shows and keeps what it measured.
`--quick`: the SmolLM2 shape only, fewer calls per timing and a 50 s budget after which
the remaining measurements are skipped (each skip is printed).

Ops (bf16 weights and hidden states, float32 logits), per shape and batch (1, 8), each the
code the JAX engine runs:
  vocab_topk      `pallas_kernels.dspine_proposal.vocab_top_k` of [B * (K-1), D] hidden
                  states against the lm_head; implementations "xla" (the full [N, V]
                  float32 logits, then lax.top_k) and "pallas_gpu" (on a CPU: interpreted,
                  tiny shape only; "pallas_tpu" on a TPU). A Pallas row carries ids_match
                  (share of the [N, C] ids equal to xla's) and max_value_diff.
  transition      `transition_table` for every slot: P = C predecessor ids, the C candidates'
                  lm_head rows gathered inside the call (as the torch op reads ids)
  chain_walk      `walk_chain` over the K-1 slots and the token gather, T = 0 (greedy) and
                  T = 0.8 / top-p 0.9 / top-k 20, one PRNG key per row
  injection       one drafter layer's gated write, `BlockDrafter._inject` on an
                  `Injection` module (readout matmul, gate, message, write); the anchor's
                  code is an input, as on the torch side
  acceptance      `verify_logits` of a `CandidateProposal` (C candidates per slot) over the
                  target's [B, K, V] logits, T = 0 (all greedy) and T = 0.8
Shapes: Qwen3-8B-like (D 4096, V 151936, r 512, m 256, K 16, C 16) and SmolLM2-135M
(D 576, V 49152, r 512, m 256, K 16, C 16); on a CPU the default is a tiny shape (D 64,
V 512, r 16, m 8, K 5, C 4) and Pallas's interpreter (its timings mean nothing; it checks
that the script runs and the implementations agree).

Timing: each op jitted once; a warm-up call, then n back-to-back calls (JAX dispatches
them asynchronously, in stream order) and one block_until_ready on the last result; the
median over repeats of (elapsed / n), in microseconds per call (the torch side times n
back-to-back launches with CUDA events). Each call takes and returns plain arrays, so an
op shorter than JAX's per-call dispatch (a few us) is timed at that dispatch, as a torch
op shorter than its launches is. Bytes per call are torch_kernels.py's formulas, copied as
they are (both sides divide by the same number, whatever dtype JAX holds, e.g. int32 ids
where torch has int64); GB/s is that over the time and pct_copy its share of a measured
device-to-device copy (read + write bytes of a 1 GiB `x + 1`, which XLA cannot elide).

Not the same work as the torch op: `transition` here also computes the predecessors'
transfer codes, gates and messages, which torch_kernels.py precomputes outside its timed
call (`gated_messages`); the bytes stay torch's. The T > 0 walks and acceptance draw from
JAX keys where torch is given uniforms.

Imports only jax, flax, pallas_kernels and dspine_jax.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspine_benchmarks.kernel_cases import SHAPES, QuickBudget, op_bytes, plan
from dspine_jax import row_keys
from dspine_jax.drafters.injection import Injection
from dspine_jax.drafters.model import BlockDrafter
from dspine_jax.sampling import SamplingParams
from dspine_jax.speculative.propose import CandidateProposal
from dspine_jax.speculative.verify import verify_logits
from pallas_kernels.dspine_proposal import (
    TransitionWeights,
    transition_table,
    vocab_top_k,
    walk_chain,
)
from pallas_kernels.switches import Switches

EPS = 1e-6
BF16 = jnp.bfloat16


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "gpu", "tpu", "cpu"],
                    help="JAX platform to run on (auto: JAX's default backend)")
    ap.add_argument("--shapes", default=None, help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--batches", default=None, help="comma list (default 1,8; cpu: 1)")
    ap.add_argument("--iters", type=int, default=None, help="calls per timing (default 50)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true",
                    help="SmolLM2 shape, few calls, 50 s budget (< 60 s total)")
    ap.add_argument("--out", default=None, help="write the rows as JSON (after every row)")
    return ap.parse_args(argv)


class Case(NamedTuple):
    """One timed call: fn(*args), jitted (its bytes: `kernel_cases.op_bytes`)."""
    op: str
    variant: str
    implementation: str
    fn: Callable
    args: tuple


class _InjectingLayer:
    """What `BlockDrafter._inject` reads of its drafter: the injection module and `code`.
    Here `code` hands back the anchor's code, given as an input (the torch op takes it too;
    the lookup is a [B] gather outside the layer's write)."""

    def __init__(self, injection: Injection, anchor_code):
        self.injection = injection
        self._anchor_code = anchor_code

    def code(self, tokens, output_embedding):
        return self._anchor_code


def timed(fn, args, iters: int, repeats: int) -> float:
    """Microseconds per call: median over repeats of (n back-to-back calls) / n."""
    jax.block_until_ready(fn(*args))                 # compile + warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)                   # calls run in order: the last ends last
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples)


def copy_bandwidth(iters: int, repeats: int) -> float:
    """GB/s of a 1 GiB device-to-device pass (read + write bytes): `x + 1`, which XLA must
    compute (a plain copy or `x + 0` can be forwarded without touching memory), on uint32
    words rather than bytes (the same 1 GiB; no byte-wide accesses in XLA's loop)."""
    x = jnp.zeros((1 << 28,), jnp.uint32)                                # 1 GiB
    us = timed(jax.jit(lambda x: x + jnp.uint32(1)), (x,), iters, repeats)
    return 2 * x.nbytes / us / 1e3


def jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:     # a source build without metadata
        import jaxlib
        return jaxlib.__version__


def pallas_implementation(platform: str, shape: str) -> tuple[str, bool] | None:
    """(implementation, interpret) of the Pallas vocab_top_k on this platform, or None."""
    if platform == "gpu":
        return "pallas_gpu", False
    if platform == "tpu":
        return "pallas_tpu", False
    # The interpreter runs the kernel's grid in Python: only the tiny shape is affordable.
    return ("pallas_gpu", True) if shape == "tiny" else None


def build_cases(s: dict, batch: int, pallas: tuple[str, bool] | None, seed: int = 0):
    """The cases of one shape and batch, inputs as in torch_kernels.py (same scales).

    Legend: N = batch * (K-1) drafted slots, D hidden, V vocab, r rank, m message, C
    candidates. Returns (cases, xla_ids [N, C]) (ids feed the later ops, as on torch)."""
    d, v, r, m, k, c = s["d"], s["v"], s["r"], s["m"], s["k"], s["c"]
    n = batch * (k - 1)
    keys = iter(jax.random.split(jax.random.key(seed), 32))

    def randn(*shape, dtype=jnp.float32, scale=1.0):
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(dtype)

    lm_head = randn(v, d, dtype=BF16, scale=0.02)                        # [V, D]
    inj = Injection(d, r, m, 1, dtype=BF16, rngs=nnx.Rngs(seed))
    # The module starts with W and B at zero (a fresh DSpine is DFlash): set every weight.
    inj.readouts[0].weight[...] = randn(r, d, dtype=BF16, scale=0.02)
    inj.receiver_gate.weight[...] = randn(m, r, dtype=BF16, scale=0.05)
    inj.predecessor_gate.weight[...] = randn(m, r, dtype=BF16, scale=0.05)
    inj.bias[...] = randn(m, dtype=BF16)
    inj.message.weight[...] = randn(m, r, dtype=BF16, scale=0.05)
    inj.writes[0].weight[...] = randn(d, m, dtype=BF16, scale=0.05)
    weights = TransitionWeights(
        readout=inj.readouts[0].weight[...], write=inj.writes[0].weight[...],
        message=inj.message.weight[...], receiver_gate=inj.receiver_gate.weight[...],
        predecessor_gate=inj.predecessor_gate.weight[...], bias=inj.bias[...],
        norm_weight=jnp.ones((d,), BF16), transfer_mean=randn(d, scale=0.01),
        transfer_whiten=randn(d, r, scale=0.1))
    cases = []

    hidden = randn(n, d, dtype=BF16)                                     # [N, D]
    impls = [("xla", False)] + ([pallas] if pallas else [])
    for impl, interpret in impls:
        fn = jax.jit(functools.partial(vocab_top_k, k=c, implementation=impl,
                                       interpret=interpret))
        cases.append(Case("vocab_topk", f"C={c}", impl, fn, (hidden, lm_head)))
    _, ids = vocab_top_k(hidden, lm_head, c, implementation="xla")       # [N, C]

    # Slot j's predecessors: slot j-1's candidates (torch: ids.roll(1, 0)).
    preds = jnp.roll(ids, 1, axis=0)

    @jax.jit
    def transition(pre, preds, cands, emb, w):
        rows = jnp.take(emb, cands, axis=0)                              # [N, C, D]
        return transition_table(pre, preds, rows, emb, w, EPS)           # [N, P=C, C]

    args = (hidden, preds, ids, lm_head, weights)
    cases.append(Case("transition", f"C={c}", "xla", transition, args))

    table = transition(*args).reshape(batch, k - 1, c, c)               # [B, K-1, C, C]
    cands = ids.reshape(batch, k - 1, c)                                 # [B, K-1, C]
    rng = row_keys.row_keys(jnp.arange(batch))                           # [B] keys

    @functools.partial(jax.jit, static_argnames="greedy")
    def chain(table, cands, temperature, top_p, top_k, rng, greedy):
        choice, q = walk_chain(table, temperature, top_p, top_k, rng, greedy=greedy)
        # the proposer's gather of the chosen ids (torch's chain_walk returns tokens too)
        tokens = jnp.take_along_axis(cands, choice[..., None], -1)[..., 0]
        return tokens, q, choice                                         # [B, K-1], ...

    for variant, (t, p, top_k) in (("T=0", (0.0, 1.0, 0)), ("T=0.8", (0.8, 0.9, 20))):
        fn = functools.partial(chain, greedy=t == 0)
        settings = (jnp.full((batch,), t, jnp.float32), jnp.full((batch,), p, jnp.float32),
                    jnp.full((batch,), top_k, jnp.int32))                # [B] each
        cases.append(Case("chain_walk", variant, "xla", fn, (table, cands, *settings, rng)))

    h = randn(batch, k, d, dtype=BF16)                                   # [B, K, D]
    code = randn(batch, r)                                               # [B, r] sqrt(r) c
    graph, state = nnx.split(inj)
    # The module's arrays travel as a plain list: jit flattens a list in C++, while an
    # nnx.State (like any Python-registered pytree) costs a Python call per dispatch.
    leaves, treedef = jax.tree.flatten(state)

    @jax.jit
    def injection(leaves, h, code):
        module = nnx.merge(graph, jax.tree.unflatten(treedef, leaves))
        layer = _InjectingLayer(module, code[:, None])                   # one block: n = 1
        out, gate = BlockDrafter._inject(layer, 0, h[:, None], None, None, None, None)
        return out[:, 0], gate[:, 0]                                     # [B, K, D], [B, K, m]

    cases.append(Case("injection", f"r={r},m={m}", "xla", injection, (leaves, h, code)))

    logits = randn(batch, k, v, scale=3.0)                               # [B, K, V]
    draft = jnp.argmax(logits[:, :-1], -1).astype(jnp.int32)             # [B, K-1]
    draft = draft.at[:, k // 2].set((draft[:, k // 2] + 1) % v)         # a rejection midway
    probs = jax.nn.softmax(randn(batch, k - 1, c), -1)                   # [B, K-1, C]
    q_ids = jnp.concatenate([draft[..., None], cands[..., 1:]], -1)      # draft is candidate 0

    # Arrays in, arrays out: the proposal and the settings are built inside the call, for
    # the same reason as the injection's module.
    @functools.partial(jax.jit, static_argnames="greedy")
    def accept(logits, tokens, q_tokens, candidates, q, temperature, top_p, top_k, rng,
               greedy):
        proposal = CandidateProposal(tokens=tokens, q_tokens=q_tokens, candidates=candidates,
                                     q=q, vocab_size=v)
        sampling = SamplingParams(temperature, top_p, top_k, all_greedy=greedy)
        verdict = verify_logits(proposal, logits, sampling, rng)
        return verdict.num_accepted, verdict.next_token                  # [B], [B]

    for variant, temp in (("T=0", 0.0), ("T=0.8", 0.8)):
        sampling = SamplingParams.create(batch, temp)      # top-p 1, top-k 0, as on torch
        cases.append(Case("acceptance", variant, "xla",
                          functools.partial(accept, greedy=sampling.all_greedy),
                          (logits, draft, probs[..., 0], q_ids, probs, sampling.temperature,
                           sampling.top_p, sampling.top_k, rng)))
    return cases, ids


def agreement(case: Case, reference: Case) -> dict:
    """A second implementation against the first: share of ids equal, max value diff."""
    (v_got, i_got), (v_want, i_want) = case.fn(*case.args), reference.fn(*reference.args)
    return {"ids_match": round(float(jnp.mean(i_got == i_want)), 4),
            "max_value_diff": float(jnp.max(jnp.abs(v_got - v_want)))}


def main(argv=None):
    args = parse(argv)
    sys.stdout.reconfigure(line_buffering=True)        # one flushed line per row
    budget = QuickBudget(args.quick)
    try:
        device = jax.devices()[0] if args.device == "auto" else jax.devices(args.device)[0]
    except RuntimeError as e:
        sys.exit(f"no {args.device} device ({e}); run with --device cpu for the smoke run")
    platform = device.platform
    cpu = platform == "cpu"
    shapes, batches, iters, repeats = plan(args, cpu)
    over_budget = budget.spent
    # the DSPINE_* switches (DSPINE_CHAIN_WALK, ...) as a decoder would read them
    with jax.default_device(device), Switches.from_environment().active():
        copy_gbs = None if cpu else copy_bandwidth(iters, repeats)
        name = "cpu (Pallas interpreter)" if cpu else device.device_kind
        print(f"device: {name}; jax {jax.__version__}, jaxlib {jaxlib_version()}; copy "
              f"bandwidth {copy_gbs and round(copy_gbs)} GB/s")
        rows = []
        meta = {"date": datetime.date.today().isoformat(),
                "device": "cpu" if cpu else device.device_kind, "platform": platform,
                "jax": jax.__version__, "jaxlib": jaxlib_version(), "copy_gbs": copy_gbs,
                "quick": args.quick, "iters": iters, "repeats": repeats,
                "pallas_interpret": cpu}

        def save():
            if args.out:
                Path(args.out).write_text(json.dumps({**meta, "kernels": rows}, indent=1))

        def record(shape, batch, case: Case, us: float, extra: dict):
            nbytes = op_bytes(case.op, SHAPES[shape], batch)
            gbs = nbytes / us / 1e3
            row = dict(shape=shape, batch=batch, op=case.op, variant=case.variant,
                       implementation=case.implementation, us=round(us, 1),
                       bytes=nbytes, gbs=round(gbs, 1),
                       pct_copy=round(100 * gbs / copy_gbs, 1) if copy_gbs else None, **extra)
            rows.append(row)
            print(f"{shape:13s} bs{batch:<2d} {case.op:11s} {case.variant:10s} "
                  f"{case.implementation:10s} {us:9.1f} us  {row['gbs']:8.1f} GB/s"
                  + (f" ({row['pct_copy']}% copy)" if copy_gbs else "")
                  + "".join(f"  {k} {v}" for k, v in extra.items()))
            save()

        for shape in shapes:
            s = SHAPES[shape]
            for batch in batches:
                if over_budget(f"kernels {shape} bs{batch}"):
                    continue
                print(f"{shape} bs{batch}: timing kernels")
                pallas = pallas_implementation(platform, shape)
                if pallas is None:
                    print(f"  vocab_topk: no Pallas row ({platform}: the interpreter runs "
                          "only the tiny shape)")
                cases, _ = build_cases(s, batch, pallas)
                first = {}
                for case in cases:
                    if over_budget(f"{shape} bs{batch} {case.op} {case.variant} "
                                   f"{case.implementation}"):
                        continue
                    key = (case.op, case.variant)
                    extra = agreement(case, first[key]) if key in first else {}
                    first.setdefault(key, case)
                    record(shape, batch, case, timed(case.fn, case.args, iters, repeats),
                           extra)
                del cases
        save()
    print(f"done in {time.perf_counter() - budget.start:.1f} s")
    return rows


if __name__ == "__main__":
    main()
