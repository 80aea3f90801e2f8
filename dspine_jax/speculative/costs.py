"""The speculation cost table of one device, target and drafter, measured on purpose
(`dspine info --speculation-costs`) rather than while decoding: each verify width's
decode call timed at each batch size, stored where the adaptive policy reads its costs
(so decoding starts with them), and the width the policy would pick per batch size at an
acceptance profile.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from dspine_jax.runtime.fixed_batch import FixedBatch
from dspine_jax.speculative.policy import expected_tokens

PROMPT_TOKENS = 64


def measure(engine, batch_sizes: list[int], repeats: int = 3, seed: int = 0) -> None:
    """Time each width's decode call (steps_per_call passes) at each batch size on random
    prompts of PROMPT_TOKENS tokens, median of `repeats` after one untimed run, into the
    engine's policy; then save the policy's file."""
    rng = np.random.default_rng(seed)
    vocab = engine.config.vocab_size
    budget = engine.steps_per_call * engine.block_size + 1     # no row finishes in a call
    for rows in batch_sizes:
        prompts = [rng.integers(0, vocab, PROMPT_TOKENS).tolist() for _ in range(rows)]
        batch = FixedBatch(engine, prompts, max_new_tokens=budget, ignore_eos=True)
        for width in engine.widths:
            samples = []
            for attempt in range(repeats + 1):
                state = jax.block_until_ready(batch.prefill())
                start = time.perf_counter()
                state = jax.block_until_ready(batch.decode(state, width))
                if attempt:
                    samples.append((time.perf_counter() - start) / engine.steps_per_call)
            engine.policy.costs.set(rows, width, statistics.median(samples))
    engine.policy.save(engine.policy_file())


def report(engine, batch_sizes: list[int], acceptance: float | None = None) -> dict:
    """Per batch size: ms per pass of each width, the expected tokens per second and the
    width the policy picks, at a constant per-slot acceptance `acceptance` or, without
    one, the acceptance pooled from earlier decoding (saved with the costs)."""
    policy = engine.policy
    alpha = ([acceptance] * policy.slots if acceptance is not None else policy.pool.alpha())
    table = {}
    for rows in batch_sizes:
        costs = {w: policy.costs.estimate(rows, w) for w in engine.widths}
        rates = {w: rows * expected_tokens(alpha, w) / c for w, c in costs.items() if c}
        pick = policy.pick(rates)
        table[str(rows)] = {
            "ms_per_pass": {str(w): round(c * 1e3, 3) for w, c in costs.items() if c},
            "tokens_per_s": {str(w): round(r, 1) for w, r in rates.items()},
            "expected_tokens_per_pass": {str(w): round(expected_tokens(alpha, w), 3)
                                         for w in engine.widths},
            "adaptive_width": pick,
            "x_fixed": round(rates[pick] / rates[engine.widths[-1]], 3),
            "x_ar": round(rates[pick] / rates[0], 3) if 0 in rates else None}
    device = jax.devices()[0]
    return {"device": f"{device.platform}:{device.device_kind}",
            "acceptance": [round(a, 3) for a in alpha],
            "acceptance_source": "given" if acceptance is not None else "measured (pooled)",
            "cost_file": str(engine.policy_file()), "batch_sizes": table}
