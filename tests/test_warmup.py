"""The engine's start-up: `warmup` compiles the programs that run any request, the others
compile in background threads, and until one is ready its calls run on a compiled program
that computes the same rows (`Runner.cover`), so nothing compiles in the engine's thread
and no request's tokens change."""

from __future__ import annotations

import threading
import time

import pytest

from dspine_jax.engine import SpeculativeEngine
from dspine_jax.generate import AutoregressiveGenerator
from dspine_jax.runtime import slot_steps
from dspine_jax.runtime.engine_core import EngineConfig, EngineCore, SamplingOptions
from dspine_jax.runtime.offline import generate_tokens
from dspine_jax.speculative.policy import CostTable, SpeculationConfig
from tests.test_engine import PROMPTS, build

BLOCK = 8


def serve(core, requests):
    """requests: (prompt, options) -> each one's tokens and the widths its passes ran at."""
    for i, (prompt, options) in enumerate(requests):
        core.add_request(str(i), prompt, options)
    tokens = {str(i): [] for i in range(len(requests))}
    widths = {str(i): set() for i in range(len(requests))}
    while core.has_work():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            if out.accept_lengths:
                widths[out.request_id].add(out.verify_width)
    return [tokens[str(i)] for i in range(len(requests))], set().union(*widths.values())


def adaptive_engine(costs: dict[int, float]):
    """An adaptive DSpine engine whose cost table at 1 and 4 rows is `costs` (ms per
    pass by width), three prompts, and AR's 12 tokens for each."""
    target, drafter = build(kind="dspine", block=BLOCK)
    ar = AutoregressiveGenerator(target, eos_token_ids=[0])
    prompts = PROMPTS[:3]
    want = [g.tokens for g in generate_tokens(ar, prompts, max_new_tokens=12).generations]
    engine = SpeculativeEngine(target, drafter, eos_token_ids=[0], steps_per_call=2,
                               speculation=SpeculationConfig("adaptive"))
    engine.policy.costs = CostTable()
    for rows in (1, 4):
        for width, ms in costs.items():
            engine.policy.costs.set(rows, width, ms)
    return engine, prompts, want


def wait_compiled(core, seconds: float = 300) -> None:
    """Until no program compiles in the background (at most `seconds`)."""
    deadline = time.monotonic() + seconds
    while core.compiling:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.fixture
def held_compiles(monkeypatch):
    """Background compiles wait until the returned Event is set."""
    gate = threading.Event()
    real = slot_steps.CompiledSteps._compile

    def gated(self, *args, **kwargs):
        if threading.current_thread().name.startswith("dspine-compile"):
            assert gate.wait(300)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(slot_steps.CompiledSteps, "_compile", gated)
    yield gate
    gate.set()


def test_requests_run_on_the_first_programs_while_the_rest_compile(held_compiles):
    # a plain step (width 0) far the cheaper
    engine, prompts, want = adaptive_engine({0: 1.0, BLOCK - 1: 100.0})
    core = EngineCore(engine, EngineConfig(max_slots=4, max_model_len=64,
                                           verify_widths=(0, BLOCK - 1)))
    s = core.scheduler
    assert s.row_sizes == [1, 4] and s.chunk_sizes == [16, 64] and s.widths == (0, BLOCK - 1)

    core.warmup()
    steps = slot_steps.compiled(engine)
    # first: decode at width 7 over 1 row greedy and 4 rows greedy and filtered; prefill
    # (1, 64), (4, 64); and on the CPU decode over 1 row filtered and prefill (1, 16) (on
    # an accelerator the larger programs cover them). Later: unfiltered at rows 1 and 4,
    # the 6 decode programs at width 0, prefill (4, 16).
    first = steps.compiles
    assert first == 7 and core.compiling == 9 and core.stats().compiling == 9
    assert {(t.name, t.key[1:]) for t in core.program_timings} == {
        ("decode", (1, "greedy", 7)), ("decode", (1, "filtered", 7)),
        ("decode", (4, "greedy", 7)), ("decode", (4, "filtered", 7)),
        ("prefill", (1, 16)), ("prefill", (1, 64)), ("prefill", (4, 64))}

    greedy = SamplingOptions(max_tokens=12, temperature=0.0)
    plain = SamplingOptions(max_tokens=12, temperature=1.0, seed=3)              # unfiltered
    filtered = SamplingOptions(max_tokens=12, temperature=0.8, top_p=0.9, seed=4)
    sampled = [(prompts[0], plain), (prompts[1], filtered)]
    got, widths = serve(core, [(p, greedy) for p in prompts])       # prefill (4, 16) covered
    assert got == want and widths == {BLOCK - 1}      # width 0 not compiled yet: the widest
    alone, _ = serve(core, [(prompts[2], greedy)])
    assert alone == want[2:]
    covered, _ = serve(core, sampled)             # 2 unfiltered rows: 4 rows, filtered
    assert steps.compiles == first, "a call compiled in the engine's thread"

    held_compiles.set()
    wait_compiled(core)
    assert steps.compiles == first + 9
    got, widths = serve(core, [(p, greedy) for p in prompts])
    assert got == want and widths == {0}          # the policy's choice, compiled now
    own, _ = serve(core, sampled)
    assert own == covered                          # a seeded sample, the same on either
    assert steps.compiles == first + 9
    core.close()


def test_warmup_with_a_restricted_set_of_modes_compiles_only_those():
    """A caller whose requests are all greedy compiles greedy programs alone, first or in
    the background."""
    target, drafter = build(kind="dspine", block=BLOCK)
    engine = SpeculativeEngine(target, drafter, eos_token_ids=[0], steps_per_call=2,
                               speculation=SpeculationConfig("fixed"))
    core = EngineCore(engine, EngineConfig(max_slots=2, max_model_len=32))
    s = core.scheduler
    # no chunk past the first that holds the longest prompt the context leaves room for
    assert s.row_sizes == [1, 2] and s.chunk_sizes == [16, 64] and len(s.widths) == 1
    core.warmup(modes=("greedy",))
    steps = slot_steps.compiled(engine)
    wait_compiled(core)
    modes = {key[2] for (name, key) in steps._executables if name == "decode"}
    assert modes == {"greedy"}
    # decode at rows 1, 2; prefill (1, 16), (1, 64), (2, 64), then (2, 16) later
    assert steps.compiles == 6
    core.close()


def test_the_engine_verifies_at_every_adaptive_width_once_compiled(held_compiles):
    """By default an engine may verify at each of adaptive speculation's widths: the
    widest is ready before serving, the narrower ones compile in the background, and a
    policy whose costs make a middle width the best picks it once it is compiled (the
    widest covers it until then), with AR's tokens either way."""
    # width 3 the best at any acceptance
    engine, prompts, want = adaptive_engine({0: 100.0, 1: 100.0, 3: 1.0, 7: 100.0})
    core = EngineCore(engine, EngineConfig(max_slots=4, max_model_len=64))
    assert core.scheduler.widths == (0, 1, 3, 7) == engine.widths
    assert core.config.verify_widths == (0, 1, 3, 7)
    core.warmup(modes=("greedy",))
    ready = {t.key[1:] for t in core.program_timings if t.name == "decode"}
    assert {width for _, _, width in ready} == {BLOCK - 1}
    greedy = SamplingOptions(max_tokens=12, temperature=0.0)
    got, widths = serve(core, [(p, greedy) for p in prompts])
    assert got == want and widths == {BLOCK - 1}     # width 3 not compiled yet: the widest
    held_compiles.set()
    wait_compiled(core)
    got, widths = serve(core, [(p, greedy) for p in prompts])
    assert got == want and widths == {3}
    core.close()
