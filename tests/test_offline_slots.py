"""Offline generation on the one engine (`Pipeline.generate`, `dspine generate`): B slots of
continuous batching. At T = 0 every response is the target's greedy one (AR's) whatever
the slot count, acceptance lengths included for a drafter; a sampled prompt's response
depends on its seed alone, not on the slot count; bad input is refused before anything
compiles.

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
from dspine_jax.runtime import slot_steps

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
def test_slots_give_each_prompt_its_greedy_response_at_t0(loaded, dspine, method):
    """Seven prompts through 3 slots (finished rows' slots take the next prompts) against
    each prompt alone; both are AR's greedy tokens (a drafter's rows take different numbers
    of passes)."""
    ar = Pipeline.from_loaded(loaded, method="ar")
    pipe = dspine if method == "dspine" else ar
    slots = pipe.generate(PROMPTS, max_new_tokens=20, batch_size=3)
    alone = [pipe.generate([p], max_new_tokens=20, batch_size=1)[0] for p in PROMPTS]
    greedy = ar.generate(PROMPTS, max_new_tokens=20, batch_size=len(PROMPTS))
    assert [r.tokens for r in slots] == [r.tokens for r in alone] == [r.tokens for r in greedy]
    assert [r.finish_reason for r in slots] == [r.finish_reason for r in alone]
    for s, a in zip(slots, alone):
        assert s.prompt_tokens == a.prompt_tokens and s.batch_size == 3
        assert s.accept_lengths == a.accept_lengths   # each row verifies on its own
        assert sum(s.accept_lengths) == len(s.tokens) - 1   # the prefill emits the first
    if method == "dspine":   # the random drafter is not always rejected
        assert max(max(r.accept_lengths) for r in slots) > 1
    assert all(r.seconds > 0 for r in slots)


def test_sampled_response_depends_on_its_seed_not_the_slot_count(dspine):
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    one = dspine.generate(PROMPTS[:4], batch_size=1, **kw)
    four = dspine.generate(PROMPTS[:4], batch_size=4, **kw)
    assert [r.tokens for r in one] == [r.tokens for r in four]
    assert all(len(r.tokens) == 16 for r in one)
    # prompt i samples from seed + i: the second prompt alone at seed 6 is the same text
    [alone] = dspine.generate(PROMPTS[1:2], batch_size=2, **{**kw, "seed": 6})
    assert alone.tokens == one[1].tokens
    other = dspine.generate(PROMPTS[:4], batch_size=4, **{**kw, "seed": 99})
    assert [r.tokens for r in other] != [r.tokens for r in one]


def test_bad_input_is_refused_before_compiling(dspine, monkeypatch):
    def no_compile(*_, **__):
        raise AssertionError("compiled before checking the input")

    monkeypatch.setattr(slot_steps.CompiledSteps, "_compile", no_compile)
    context = dspine.decoder.config.max_position_embeddings
    with pytest.raises(InputError, match=f"prompt 0: .*context of {context}"):
        dspine.generate(PROMPTS, max_new_tokens=context)
    with pytest.raises(InputError, match="positive integer"):
        dspine.generate(PROMPTS, batch_size=0)
    with pytest.raises(InputError, match="no prompts"):
        dspine.generate([])


def test_generate_command_takes_batch_size_slots(tiny_llama_dir, loaded, tmp_path):
    from dspine_cli.main import app

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:5]))
    args = ["generate", "--target", str(tiny_llama_dir), "--method", "ar", "--dtype", "f32",
            "--prompts-file", str(prompts), "-n", "12", "--json"]
    runs = {b: CliRunner().invoke(app, args + ["--batch-size", str(b)]) for b in (2, 5)}
    for b, run in runs.items():
        assert run.exit_code == 0, (b, run.output)
    rows = {b: [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
            for b, run in runs.items()}
    assert len(rows[2]) == 5 and [r["batch_size"] for r in rows[2]] == [2] * 5
    assert [r["tokens"] for r in rows[2]] == [r["tokens"] for r in rows[5]]


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


@pytest.mark.parametrize("slots", [4, 2])
def test_compile_ahead_covers_what_the_run_takes(loaded, tiny_dspine_dir, monkeypatch, slots):
    """On an accelerator an offline run compiles its programs in parallel before it
    starts: a static batch (4 slots) then compiles nothing on first use, and a run that
    refills its slots (2) at most its refills' prefill shapes; the tokens are AR's."""
    from dspine_jax.runtime import engine_core, offline

    pipe = Pipeline.from_loaded(loaded, tiny_dspine_dir, speculation=SpeculationConfig("fixed"))
    steps = slot_steps.compiled(pipe.decoder)
    ahead = []
    real = engine_core.EngineCore.compile_ahead

    def spy(core, *args):
        real(core, *args)
        ahead.append(steps.compiles)

    monkeypatch.setattr(offline.jax, "default_backend", lambda: "gpu")
    # the pretended GPU's sampled programs warp by a sort: the Pallas threshold kernel
    # compiles only on a real one
    monkeypatch.setattr("dspine_jax.sampling.gpu_threshold_implementation", lambda: "sort")
    monkeypatch.setattr(engine_core.EngineCore, "compile_ahead", spy)
    prompts = PROMPTS[:4]
    results = pipe.generate(prompts, max_new_tokens=12, batch_size=slots, ignore_eos=True)
    assert len(ahead) == 1 and ahead[0] > 0
    later = steps.compiles - ahead[0]
    assert later == 0 if slots == 4 else later <= 1
    ar = Pipeline.from_loaded(loaded, method="ar").generate(prompts, max_new_tokens=12,
                                                            batch_size=4, ignore_eos=True)
    assert [r.tokens for r in results] == [r.tokens for r in ar]


def test_generate_fills_the_compile_cache_it_is_given(tiny_llama_dir, tmp_path):
    """`dspine generate` keeps its compiled programs in --compile-cache-dir, JAX's and the
    program store's (a process of its own: the cache is a process-wide JAX setting); the
    next run loads the stored programs, and `none` writes nothing."""
    import os
    import subprocess
    import sys

    def generate(cache: str) -> dict:
        run = subprocess.run(
            [sys.executable, "-m", "dspine_cli", "generate", "--target", str(tiny_llama_dir),
             "--method", "ar", "--dtype", "f32", "-p", "the quick", "-n", "4", "--json",
             "--compile-cache-dir", cache],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "DSPINE_CACHE_DIR": str(tmp_path / "home")})
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)

    cache = tmp_path / "cache"
    first = generate(str(cache))
    programs = [p for p in cache.iterdir() if p.name.endswith("-cache")]
    assert any("decode_rows" in p.name for p in programs)
    stored = {p: p.stat().st_mtime_ns for p in (cache / "programs").glob("*.program")}
    assert stored
    assert generate(str(cache))["tokens"] == first["tokens"]
    # the same programs, each read again (a read marks an entry recently used)
    assert {p: p.stat().st_mtime_ns for p in (cache / "programs").glob("*.program")}.keys() \
        == stored.keys()
    assert all(p.stat().st_mtime_ns > t for p, t in stored.items())
    generate("none")
    assert not (tmp_path / "home" / "jax-compile-cache").exists()
