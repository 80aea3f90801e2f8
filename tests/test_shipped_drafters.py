"""The shipped SmolLM2 drafters' quality: a fixed CPU evaluation that a regression fails.

16 chat prompts from the packaged benchmarks (the first four of at most 600 characters of
MATH-500, HumanEval, MT-Bench and held-out ShareGPT), 64 new tokens each, T = 0, one
batch of 16, the built-in target smollm2-135m-instruct in float32. Each drafter's tau
(tokens per target verify pass, pooled over the prompts) must stay within 10% of the
committed figure, DSpine must lead DFlash by MARGIN, and the two must decode the same
tokens (at T = 0 both are the target's greedy decoding; test_smollm2 checks that against
AR).

The committed figures (tests/fixtures/shipped_drafter_quality.json) are written by
    python -m tests.test_shipped_drafters --write
"""

from __future__ import annotations

import json
import platform
import sys
from datetime import date
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FIGURES = Path(__file__).parent / "fixtures" / "shipped_drafter_quality.json"
TARGET = "smollm2-135m-instruct"
KINDS = ("dflash", "dspine")
SOURCES = ("math500", "humaneval", "mtbench", "sharegpt")
PER_SOURCE, MAX_CHARS, MAX_NEW_TOKENS, BATCH = 4, 300, 64, 16
TOLERANCE = 0.10   # each tau within 10% of its committed figure
MARGIN = 1.05      # DSpine's tau at least 5% above DFlash's


def quality_prompts() -> list[str]:
    """The fixed prompt set: the first PER_SOURCE prompts of at most MAX_CHARS characters
    of each source, in order."""
    from dspine_jax.evaluation.benchmarks import load_benchmark

    prompts = []
    for name in SOURCES:
        short = [p["prompt"] for p in load_benchmark(name) if len(p["prompt"]) <= MAX_CHARS]
        prompts += short[:PER_SOURCE]
    return prompts


def measure() -> dict:
    """Decode the prompt set with each shipped drafter -> {"tau": {kind: pooled tau},
    "agree": prompts whose DFlash and DSpine tokens are equal, "prompts": count}."""
    from dspine_jax.api import Pipeline
    from dspine_jax.checkpoints import load_target
    from dspine_jax.speculative.policy import SpeculationConfig

    prompts = quality_prompts()
    loaded = load_target(TARGET, dtype="f32")
    tau, tokens = {}, {}
    for kind in KINDS:
        # every pass verifies the whole block: tau measures the drafter
        pipe = Pipeline.from_loaded(loaded, drafter=f"{TARGET}-{kind}",
                                    speculation=SpeculationConfig("fixed"))
        results = pipe.generate(prompts, chat=True, max_new_tokens=MAX_NEW_TOKENS,
                                batch_size=BATCH)
        passes = [n for r in results for n in r.accept_lengths]
        tau[kind] = sum(passes) / len(passes)
        tokens[kind] = [r.tokens for r in results]
    agree = sum(a == b for a, b in zip(*tokens.values()))
    return {"tau": tau, "agree": agree, "prompts": len(prompts)}


@pytest.fixture(scope="module")
def measured():
    return measure()


def test_the_prompt_set_is_fixed():
    prompts = quality_prompts()
    assert len(prompts) == len(SOURCES) * PER_SOURCE == 16
    assert len(set(prompts)) == 16 and all(len(p) <= MAX_CHARS for p in prompts)


def test_shipped_drafters_keep_their_acceptance(measured):
    """Each tau within TOLERANCE of its committed figure, DSpine ahead of DFlash by MARGIN,
    and the same tokens from both (the target's greedy decoding)."""
    committed = json.loads(FIGURES.read_text())["tau"]
    assert measured["agree"] == measured["prompts"]
    for kind in KINDS:
        got, want = measured["tau"][kind], committed[kind]
        assert abs(got - want) <= TOLERANCE * want, \
            f"{kind}: tau {got:.3f}, committed {want:.3f} (tolerance {TOLERANCE:.0%})"
    assert measured["tau"]["dspine"] >= MARGIN * measured["tau"]["dflash"], measured["tau"]


def write_figures() -> dict:
    import jax

    result = measure()
    figures = {
        "what": f"tau (tokens per target verify pass, pooled) of the shipped drafters on "
                f"{result['prompts']} chat prompts ({PER_SOURCE} of at most {MAX_CHARS} "
                f"characters from each of {', '.join(SOURCES)}), {MAX_NEW_TOKENS} new "
                f"tokens, T = 0, batch {BATCH}, target {TARGET} in float32, on the CPU",
        "command": "python -m tests.test_shipped_drafters --write",
        "date": date.today().isoformat(),
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "tau": {kind: round(value, 4) for kind, value in result["tau"].items()},
        "dspine_over_dflash": round(result["tau"]["dspine"] / result["tau"]["dflash"], 4),
    }
    FIGURES.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.test_shipped_drafters --write")
    print(json.dumps(write_figures(), indent=2))
