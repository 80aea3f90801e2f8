"""Offline continuous batching (`dspine_jax.runtime.offline.generate`, `dspine generate --engine
slots`): at T = 0
it equals the static batch engine token for token (the target's greedy output), acceptance
lengths included; a sampled prompt's response depends on its seed alone, not on the slot
count; bad input is refused before anything compiles.

A tiny random Llama (tests/conftest.py) with a tiny DSpine drafter, in float32 on the CPU.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dspine_jax.api import Pipeline
from dspine_jax.checkpoints import load_target
from dspine_jax.errors import InputError
from dspine_jax.speculative.policy import SpeculationConfig
from dspine_jax.runtime.offline import generate as generate_in_slots

PROMPTS = ["the quick brown fox", "hello world", "def f(x):", "the lazy dog", "over the",
           "jumps over the lazy dog", "brown fox hello"]


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_target(tiny_llama_dir, dtype="f32")


@pytest.fixture(scope="module")
def dspine(loaded, tiny_dspine_dir) -> Pipeline:
    # fixed widths: the slot engine's calls and the static batch's then run the same passes
    return Pipeline.from_loaded(loaded, tiny_dspine_dir, serving=True,
                                speculation=SpeculationConfig("fixed"))


@pytest.mark.parametrize("method", ["dspine", "ar"])
def test_slots_equal_static_batches_at_t0(loaded, dspine, method):
    """Seven prompts through 3 slots against static batches of 3; each response is the
    target's greedy one, and ignore_eos=False lets rows end at different lengths."""
    pipe = (dspine if method == "dspine"
            else Pipeline.from_loaded(loaded, method="ar", serving=True))
    batch = pipe.generate(PROMPTS, max_new_tokens=20, batch_size=3)
    slots = generate_in_slots(pipe, PROMPTS, max_new_tokens=20, slots=3)
    assert [r.tokens for r in slots] == [r.tokens for r in batch]
    assert [r.finish_reason for r in slots] == [r.finish_reason for r in batch]
    assert [r.text for r in slots] == [r.text for r in batch]
    for s, b in zip(slots, batch):
        assert s.prompt_tokens == b.prompt_tokens and s.batch_size == 3
        if method == "dspine":
            assert s.accept_lengths == b.accept_lengths
        assert sum(s.accept_lengths) == len(s.tokens) - 1   # the prefill emits the first
    if method == "dspine":   # the random drafter is not always rejected
        assert max(max(r.accept_lengths) for r in slots) > 1
    assert all(r.seconds > 0 and r.compile_seconds > 0 for r in slots)


def test_sampled_response_depends_on_its_seed_not_the_slot_count(dspine):
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    one = generate_in_slots(dspine, PROMPTS[:4], slots=1, **kw)
    four = generate_in_slots(dspine, PROMPTS[:4], slots=4, **kw)
    assert [r.tokens for r in one] == [r.tokens for r in four]
    assert all(len(r.tokens) == 16 for r in one)
    # prompt i samples from seed + i: the second prompt alone at seed 6 is the same text
    [alone] = generate_in_slots(dspine, PROMPTS[1:2], slots=2, **{**kw, "seed": 6})
    assert alone.tokens == one[1].tokens
    other = generate_in_slots(dspine, PROMPTS[:4], slots=4, **{**kw, "seed": 99})
    assert [r.tokens for r in other] != [r.tokens for r in one]


def test_bad_input_is_refused_before_compiling(dspine, monkeypatch):
    from dspine_jax.runtime.engine_core import EngineCore

    def no_warmup(*_, **__):
        raise AssertionError("compiled before checking the input")

    monkeypatch.setattr(EngineCore, "warmup", no_warmup)
    context = dspine.decoder.config.max_position_embeddings
    with pytest.raises(InputError, match=f"context of {context}"):
        generate_in_slots(dspine, PROMPTS, max_new_tokens=context)
    with pytest.raises(InputError, match="positive integer"):
        generate_in_slots(dspine, PROMPTS, slots=0)
    with pytest.raises(InputError, match="no prompts"):
        generate_in_slots(dspine, [])


def test_generate_command_with_slots(tiny_llama_dir, loaded, tmp_path):
    from dspine_cli.main import app

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:5]))
    args = ["generate", "--target", str(tiny_llama_dir), "--method", "ar", "--dtype", "f32",
            "--prompts-file", str(prompts), "-n", "12", "--batch-size", "2", "--json"]
    runs = {e: CliRunner().invoke(app, args + ["--engine", e]) for e in ("batch", "slots")}
    for e, run in runs.items():
        assert run.exit_code == 0, (e, run.output)
    rows = {e: [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
            for e, run in runs.items()}
    assert len(rows["slots"]) == 5
    assert [r["tokens"] for r in rows["slots"]] == [r["tokens"] for r in rows["batch"]]
    bad = CliRunner().invoke(app, args + ["--engine", "static"])
    assert bad.exit_code != 0 and "--engine must be one of batch, slots" in bad.output


def test_static_batches_take_long_calls_and_the_slot_engine_short_ones(loaded, tiny_dspine_dir):
    """Passes per call: 16 at most; a serving pipeline (`dspine serve`) shares its calls
    in 8 for AR and 4 with a drafter while several rows decode; an explicit value holds
    for both."""
    def steps(*drafter, **kw):
        decoder = Pipeline.from_loaded(loaded, *drafter, **kw).decoder
        return decoder.steps_per_call, decoder.shared_steps_per_call

    assert (steps(), steps(tiny_dspine_dir)) == ((16, 16), (16, 16))
    assert (steps(serving=True), steps(tiny_dspine_dir, serving=True)) == ((16, 8), (16, 4))
    assert steps(tiny_dspine_dir, serving=True, steps_per_call=2) == (2, 2)
    with pytest.raises(InputError, match="steps_per_call"):
        Pipeline.from_loaded(loaded, steps_per_call=0)
