"""Adaptive speculation: every verify width is lossless, and the policy picks widths the
way its cost table and acceptance statistics say (synthetic tables, no JAX there)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from dspine_jax.engine import SpeculativeEngine
from dspine_jax.errors import InputError
from dspine_jax.generate import AutoregressiveGenerator
from dspine_jax.speculative.policy import (AcceptanceStats, CostTable, SpeculationConfig,
                                           SpeculationPolicy, expected_tokens,
                                           slot_acceptance)
from dspine_jax.runtime.fixed_batch import FixedBatch
from dspine_jax.runtime.offline import generate_tokens
from tests.test_engine import (PROMPTS, SAMPLING, SMALL, build, chi2_pvalue,
                               exact_two_token_distribution, sample_pairs)


# ----- the policy, host-only ------------------------------------------------------------------
def policy_with(costs: dict[int, float], alpha: float, rows: int = 1,
                **config) -> tuple[SpeculationPolicy, list[AcceptanceStats]]:
    """A policy over a 16-token block whose costs per width are `costs` (seconds per pass)
    and whose rows accept every slot with probability `alpha`."""
    policy = SpeculationPolicy(SpeculationConfig("adaptive", **config), 16)
    for width, seconds in costs.items():
        policy.costs.set(rows, width, seconds)
    rng = np.random.default_rng(0)
    stats = []
    for _ in range(rows):
        s = policy.new_row()
        for _ in range(400):            # a long run of passes at the widest width
            kept = rng.random(15) < alpha
            policy.observe_pass(s, 15, int(np.argmin(kept)) if not kept.all() else 15)
        stats.append(s)
    return policy, stats


def test_expected_tokens_is_the_chain_rule():
    assert expected_tokens([0.5] * 15, 0) == 1.0
    assert expected_tokens([0.5] * 15, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0] * 15, 15) == 16.0


def test_slot_acceptance_gives_back_the_mean_accepted_length():
    """The profile of whole-block passes reproduces their mean tokens per pass exactly
    (float64 numpy as the reference), and reads the rates off the histogram."""
    kept = np.random.default_rng(0).geometric(0.35, size=500) - 1
    kept = np.minimum(kept, 7)
    alpha = slot_acceptance(kept.tolist(), 7)
    assert expected_tokens(alpha, 7) == pytest.approx(1 + kept.mean(), rel=1e-12)
    assert alpha[0] == pytest.approx(np.mean(kept >= 1))
    assert alpha[1] == pytest.approx(np.mean(kept >= 2) / np.mean(kept >= 1))
    assert slot_acceptance([0, 0, 2], 4) == [1 / 3, 1.0, 0.0, 0.0]


def test_acceptance_stats_count_the_slots_a_pass_reached():
    s = AcceptanceStats(4, decay=1.0, prior_weight=0.0)
    s.observe(4, 2)      # slots 1, 2 kept, slot 3 rejected, slot 4 never tried
    s.observe(2, 2)      # both verified slots kept
    s.observe(0, 0)      # a plain step tells nothing about the drafts
    assert s.reached == [2, 2, 1, 0] and s.kept == [2, 2, 0, 0]
    assert s.alpha()[:3] == [1.0, 1.0, 0.0]


def test_acceptance_stats_decay_every_count_per_pass():
    """The running-factor counts equal the plain definition (every count times `decay`
    on each pass, then +1 on the slots the pass touched) over 20,000 random passes, long
    enough to rescale the factor."""
    rng = np.random.default_rng(7)
    s = AcceptanceStats(15, decay=0.98, prior=list(rng.random(15)), prior_weight=2.0)
    reached, kept = np.zeros(15), np.zeros(15)
    for _ in range(20_000):
        width = int(rng.choice([0, 1, 3, 7, 15]))
        accepted = int(rng.integers(0, width + 1))
        s.observe(width, accepted)
        if width:
            reached *= 0.98
            kept *= 0.98
            reached[:min(accepted + 1, width)] += 1
            kept[:accepted] += 1
    np.testing.assert_allclose(s.reached, reached, rtol=1e-9)
    np.testing.assert_allclose(s.kept, kept, rtol=1e-9)
    want = (kept + 2.0 * np.asarray(s.prior)) / (reached + 2.0)
    np.testing.assert_allclose(s.alpha(), want, rtol=1e-9)
    s.set_prior([0.0] * 15)                 # a new prior is seen at once (no stale cache)
    np.testing.assert_allclose(s.alpha(), kept / (reached + 2.0), rtol=1e-9)


def test_draft_cannot_pay_picks_a_plain_step():
    # a CPU: every verified token costs compute and the draft costs 3 plain steps
    costs = {0: 1.0, 1: 3.2, 3: 3.6, 7: 4.4, 15: 6.0}
    policy, stats = policy_with(costs, alpha=0.6)
    assert [policy.choose(1, stats) for _ in range(10)] == [0] * 10


def test_cheap_passes_pick_the_widest_width():
    # a GPU at batch 1: a pass reads the weights once, 16 tokens cost 1.3 steps
    costs = {0: 1.0, 1: 1.15, 3: 1.17, 7: 1.2, 15: 1.3}
    policy, stats = policy_with(costs, alpha=0.8)
    assert [policy.choose(1, stats) for _ in range(10)] == [15] * 10


def test_in_between_a_middle_width_wins():
    # large batch: verify cost grows with the tokens, acceptance falls off after 3 slots
    costs = {0: 1.0, 1: 1.2, 3: 1.4, 7: 2.2, 15: 3.6}
    policy, stats = policy_with(costs, alpha=0.7)
    assert policy.choose(1, stats) == 3
    scores = policy.scores(1, stats)
    assert max(scores, key=scores.get) == 3


def test_a_middle_width_tried_on_its_estimate_waits_for_its_time():
    """Width 3's estimated cost makes it look best: it is tried, then not again while
    its time is still to come (steps are pipelined), then kept or dropped on its
    measured cost."""
    policy, stats = policy_with({0: 1.0, 15: 2.0}, alpha=0.4)
    # the whole block's extra second over a plain step: 40% fixed, 60% over 15 drafts
    assert policy.costs.estimate(1, 3) == pytest.approx(2.0 - 0.6 * 1.0 * 12 / 15)
    assert policy.choose(1, stats) == 3
    assert [policy.choose(1, stats) for _ in range(3)] == [0] * 3     # 3's time not in
    dear, _ = policy_with({0: 1.0, 15: 2.0}, alpha=0.4)
    assert dear.choose(1, stats) == 3
    dear.observe_call(1, 3, 16 * 1.9, 16)           # a draft costs nearly the whole block
    assert 3 not in [dear.choose(1, stats) for _ in range(8)]
    policy.observe_call(1, 3, 16 * 1.52, 16)        # as estimated: kept
    assert [policy.choose(1, stats) for _ in range(3)] == [3] * 3
    untimed, _ = policy_with({0: 1.0, 15: 2.0}, alpha=0.4)
    assert untimed.choose(1, stats) == 3 and untimed.choose(1, stats) == 0
    untimed.not_timed()                 # that call's time will not come: guess again
    assert untimed.choose(1, stats) == 3


def test_narrow_widths_that_cannot_pay_are_not_tried():
    """The built-in pair on a 2-core CPU (ms per pass, fixed-width decodes of the
    README's prompt): one verified draft costs 2.5 plain steps, so no width pays. Knowing
    only the two ends, the policy runs plain steps; a line through the plain step would
    have put width 3 at 47.6 ms and tried it."""
    true = {0: 28.1, 1: 69.1, 3: 82.9, 7: 91.3, 15: 125.8}
    policy, _ = policy_with({0: true[0], 15: true[15]}, alpha=0.65)
    estimates = {w: policy.costs.estimate(1, w) for w in (1, 3, 7)}
    for w, cost in estimates.items():               # within 8% of what each costs
        assert cost == pytest.approx(true[w], rel=0.08)
    assert run_calls(policy, true, 30) == [0] * 30


def run_calls(policy: SpeculationPolicy, true: dict[int, float], calls: int,
              widths: tuple[int, ...] | None = None) -> list[int]:
    """`calls` calls of 16 passes over one row, each timed at its width's `true` cost per
    pass: -> the widths the policy picked."""
    stats, picks = [policy.new_row()], []
    for _ in range(calls):
        picks.append(policy.choose(1, stats, widths=widths))
        policy.observe_call(1, picks[-1], 16 * true[picks[-1]], 16)
    return picks


def test_both_ends_are_measured_first_then_probed():
    policy = SpeculationPolicy(SpeculationConfig("adaptive"), 16, probe_every=4,
                               probe_budget=10.0)
    stats = [policy.new_row()]
    for _ in range(3):                             # nothing known: fixed speculation first,
        assert policy.choose(2, stats) == 15       # a few calls (a median, not one call)
        policy.observe_call(2, 15, 16 * 1.3, 16)
    for _ in range(3):
        assert policy.choose(2, stats) == 0        # then a plain step
        policy.observe_call(2, 0, 16 * 1.0, 16)
    for _ in range(50):
        policy.observe_pass(stats[0], 15, 14)      # everything accepted: 15 pays
    picks = [policy.choose(2, stats) for _ in range(12)]
    assert picks.count(0) >= 2 and picks.count(15) >= 8   # the plain step is re-measured


def test_an_expensive_probe_is_rare():
    costs = {0: 1.0, 15: 5.0}
    policy, stats = policy_with(costs, alpha=0.3)
    picks = [policy.choose(1, stats) for _ in range(200)]
    # a probe of the block gives up ~70% of a call's tokens: one in 71 calls keeps the
    # loss under 1%
    assert picks.count(15) == 2


def test_a_cost_measured_wrong_does_not_stick():
    """The block's first calls ran while the device was busy (10x their true time): the
    policy picks plain steps, but the first probe contradicts that cost, is repeated, and
    within a few calls the block wins again."""
    true = {0: 1.0, 15: 1.6}
    policy, stats = policy_with({0: 1.0, 15: 16.0}, alpha=0.8)
    picks = []
    for _ in range(400):
        width = policy.choose(1, stats, widths=(0, 15))    # the serving engine's two ends
        picks.append(width)
        policy.observe_call(1, width, 16 * true[width], 16)
    first = picks.index(15)
    assert 16 <= first <= policy.probe_max              # a probe, not an immediate switch
    assert picks[first:first + 4] == [15] * 4           # rechecked until the median follows
    assert policy.costs.estimate(1, 15) == pytest.approx(1.6)
    assert picks[-100:].count(15) >= 97                 # then only the rare plain-step probe


def test_costs_are_medians_of_the_latest_calls():
    table = CostTable(window=5, min_samples=3)
    table.observe(8, 15, 9.0)                           # a first run: slow
    table.observe(8, 15, 2.0)
    assert table.trusted(8) == set()                    # not trusted yet
    table.observe(8, 15, 2.2)
    assert table.trusted(8) == {15}
    assert table.estimate(8, 15) == 2.2                 # the outlier moves nothing
    for s in (3.0, 3.1, 3.2):
        table.observe(8, 15, s)
    assert table.estimate(8, 15) == 3.0                 # the latest 5: 2.0 2.2 3.0 3.1 3.2


def test_unmeasured_widths_are_estimated():
    table = CostTable()
    table.set(8, 0, 1.0)
    table.set(8, 15, 2.5)
    # below the narrowest pass width run: down by the per-draft part (60% of 1.5 s / 15)
    assert table.estimate(8, 7) == pytest.approx(2.5 - 0.06 * 8)
    assert table.estimate(8, 1) == pytest.approx(2.5 - 0.06 * 14)
    table.set(8, 3, 2.0)
    # between two pass widths: the line through them; below both: their slope
    assert table.estimate(8, 7) == pytest.approx(2.0 + 4 / 12 * 0.5)
    assert table.estimate(8, 1) == pytest.approx(2.0 - 2 * 0.5 / 12)
    assert table.estimate(8, 15) == 2.5 and table.estimate(4, 3) is None
    steep = CostTable()                             # never below a plain step
    for width, cost in {0: 1.0, 3: 1.05, 15: 2.25}.items():
        steep.set(1, width, cost)
    assert steep.estimate(1, 1) == 1.0
    wide = CostTable()                              # wider than every width run: held
    wide.set(1, 0, 1.0)
    wide.set(1, 3, 1.5)
    assert wide.estimate(1, 15) == 1.5 and wide.estimate(1, 1) == pytest.approx(1.5 - 0.2)


def test_a_call_cut_short_does_not_start_a_recheck():
    """A last call that ran 5 of its 16 passes at twice the plain step's cost per pass
    leaves the block in place; a full call that slow makes the policy re-time the plain
    step at once."""
    for ran, rechecked in ((5, False), (16, True)):
        policy, stats = policy_with({0: 1.0, 15: 1.6}, alpha=0.8)
        assert policy.choose(1, stats, widths=(0, 15)) == 15
        policy.observe_call(1, 0, ran * 2.0, ran, 16)
        assert (policy.choose(1, stats, widths=(0, 15)) == 0) == rechecked


def test_fixed_and_off_have_one_width():
    assert SpeculationConfig("fixed").widths(16) == (15,)
    assert SpeculationConfig("fixed", 5).widths(16) == (5,)
    assert SpeculationConfig("off").widths(16) == (0,)
    assert SpeculationConfig("adaptive").widths(16) == (0, 1, 3, 7, 15)
    assert SpeculationConfig("adaptive", 5).widths(16) == (0, 1, 3, 5)


@pytest.mark.parametrize("config, block, message", [
    (SpeculationConfig("sometimes"), 16, "--speculation must be one of"),
    (SpeculationConfig("fixed", 0), 16, "--max-verify-width 0 with --speculation fixed"),
    (SpeculationConfig("adaptive", 16), 16, "holds 15 drafts"),
    (SpeculationConfig("adaptive", -1), 16, "non-negative"),
])
def test_bad_settings_are_named(config, block, message):
    with pytest.raises(InputError, match=message):
        config.validate(block)


def test_saved_costs_start_the_next_process(tmp_path):
    policy, _ = policy_with({0: 1.0, 1: 3.2, 3: 3.6, 7: 4.4, 15: 6.0}, alpha=0.6)
    path = tmp_path / "costs.json"
    policy.save(path)
    fresh = SpeculationPolicy(SpeculationConfig("adaptive"), 16)
    assert fresh.load(path)
    picks = run_calls(fresh, {0: 1.0, 15: 6.0}, 20)
    # no measuring again: the best width at once, and the block is not re-run early
    assert picks == [0] * 20
    assert json.loads(path.read_text())["costs"]
    path.write_text("{not json")
    assert not SpeculationPolicy(SpeculationConfig("adaptive"), 16).load(path)


def test_a_loaded_cost_measured_under_load_is_corrected_at_once(tmp_path):
    """A file from a busy machine says a plain step costs 2.0 (it costs 1.0): the block
    looks best and is picked first, the plain step is re-timed on the second call,
    contradicts the file, is rechecked, and wins within a few calls."""
    true = {0: 1.0, 15: 2.4}
    stale, _ = policy_with({0: 2.0, 15: 2.4}, alpha=0.4)
    path = tmp_path / "costs.json"
    stale.save(path)
    policy = SpeculationPolicy(SpeculationConfig("adaptive"), 16)
    assert policy.load(path)
    picks = run_calls(policy, true, 12, widths=(0, 15))
    assert picks[:2] == [15, 0]
    assert policy.costs.estimate(1, 0) == pytest.approx(1.0)
    assert picks[-6:] == [0] * 6


# ----- lossless at every width ----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dflash", "dspine"])
def test_greedy_equals_autoregressive_at_every_width(kind):
    target, drafter = build(kind=kind, block=8)
    ar = AutoregressiveGenerator(target, eos_token_ids=[0])
    want = generate_tokens(ar, PROMPTS[:6], max_new_tokens=20).generations
    engine = SpeculativeEngine(target, drafter, eos_token_ids=[0], steps_per_call=3,
                               speculation=SpeculationConfig("adaptive"))
    assert engine.widths == (0, 1, 3, 7)
    run = FixedBatch(engine, PROMPTS[:6], max_new_tokens=20)
    for width in engine.widths:
        state = run.prefill()
        while not np.asarray(state.done).all():
            state = run.decode(state, width)
        for row, w in enumerate(want):
            n = int(state.num_generated[row])
            assert np.asarray(state.output[row, :n]).tolist() == w.tokens, (width, row)
            lengths = np.asarray(state.pass_lengths[row, :int(state.num_passes[row])])
            assert lengths.max() <= width + 1
    # the adaptive policy over the whole request
    got = generate_tokens(engine, PROMPTS[:6], max_new_tokens=20).generations
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert sum(sum(g.verify_widths.values()) for g in got) == sum(
        len(g.accept_lengths) for g in got)


def test_calls_that_time_an_end_are_short_and_lossless(monkeypatch):
    """With nothing measured yet, a request decoding alone at 8 passes per call runs its
    first calls at MEASURING_PASSES while the policy times the widest width and a plain
    step, then full calls; the tokens are AR's."""
    from dspine_jax.runtime.runner import Runner
    from dspine_jax.runtime.scheduler import MEASURING_PASSES

    target, drafter = build(kind="dspine", block=8)
    ar = AutoregressiveGenerator(target, eos_token_ids=[0])
    want = generate_tokens(ar, PROMPTS[:1], max_new_tokens=80).generations
    engine = SpeculativeEngine(target, drafter, eos_token_ids=[0], steps_per_call=8,
                               speculation=SpeculationConfig("adaptive"))
    engine.policy.costs = CostTable()
    passes, submit = [], Runner.submit

    def recording_submit(self, call):
        if call.decode:
            passes.append(call.passes)
        return submit(self, call)

    monkeypatch.setattr(Runner, "submit", recording_submit)
    got = generate_tokens(engine, PROMPTS[:1], max_new_tokens=80).generations
    assert got[0].tokens == want[0].tokens
    assert passes[0] == MEASURING_PASSES == 4 and set(passes) <= {4, 8}


def test_a_narrower_pass_drafts_the_same_tokens():
    """DSpine drafts only as far as a pass verifies: from the same state, the drafts
    and their q at width w are the whole block's first w (greedy and sampled)."""
    import jax.numpy as jnp

    from dspine_jax import row_keys
    from dspine_jax.sampling import SamplingParams

    import jax
    from flax import nnx

    target, drafter = build(kind="dspine", block=8)
    params = nnx.state(drafter, nnx.Param)       # drafts that vary from slot to slot
    leaves, treedef = jax.tree.flatten(params)
    noise = [jax.random.normal(jax.random.key(i), x.shape, x.dtype) for i, x in enumerate(leaves)]
    nnx.update(drafter, jax.tree.unflatten(treedef, [x + n for x, n in zip(leaves, noise)]))
    engine = SpeculativeEngine(target, drafter, eos_token_ids=[0],
                               speculation=SpeculationConfig("adaptive"))
    state = FixedBatch(engine, PROMPTS[:6], max_new_tokens=20).prefill()
    keys = row_keys.row_keys(jnp.arange(6, dtype=jnp.int32))
    for sampling in (SamplingParams.create(6), SamplingParams.create(6, 1.0)):
        whole, _ = engine.draft(engine.params(), state, sampling, keys)
        assert len(set(np.asarray(whole.tokens).ravel().tolist())) > 6
        for width in (1, 3, 7):
            part, _ = engine.draft(engine.params(), state, sampling, keys, width)
            assert part.tokens.shape == (6, width)
            np.testing.assert_array_equal(part.tokens, whole.tokens[:, :width])
            np.testing.assert_allclose(part.q_tokens, whole.q_tokens[:, :width], rtol=1e-5)


@pytest.mark.parametrize("mode, width", [("fixed", 1), ("fixed", 3), ("adaptive", None)])
def test_sampling_at_a_width_follows_the_target_distribution(mode, width):
    target, drafter = build(SMALL, kind="dspine", block=4, scale=6.0)
    engine = SpeculativeEngine(target, drafter, speculation=SpeculationConfig(mode, width))
    prompt = [3, 1, 4]
    joint = exact_two_token_distribution(target, prompt, SAMPLING[0])
    counts = sample_pairs(engine, prompt, SAMPLING[0], seed=11)
    assert chi2_pvalue(counts, joint) > 1e-4


def test_speculation_modes_benchmark(tiny_llama_dir, tiny_dspine_dir, tmp_path):
    """benchmarks/speculation_modes.py with a tiny pair: every mode gives AR's tokens at
    T = 0, `off` runs plain steps only, `fixed` the whole block."""
    from dspine_benchmarks import speculation_modes

    out = tmp_path / "modes.json"
    report = speculation_modes.main([
        "--target", str(tiny_llama_dir), "--drafter", str(tiny_dspine_dir), "--prompt",
        "the quick brown fox", "--no-chat", "--modes", "fixed", "adaptive", "off",
        "--repeats", "2", "--max-new-tokens", "12", "--out", str(out)])
    assert json.loads(out.read_text())["summary"] == report["summary"]
    assert all(s["same_as_ar"] and s["median_tok_s"] > 0 for s in report["summary"].values())
    block = max(int(w) for run in report["runs"]["fixed"] for w in run["verify_widths"])
    assert all(set(run["verify_widths"]) == {"0"} for run in report["runs"]["off"])
    assert all(set(run["verify_widths"]) == {str(block)} for run in report["runs"]["fixed"])


# ----- the serving engine -------------------------------------------------------------------
def serve_all(core, prompts, **options):
    from dspine_jax.runtime.engine_core import SamplingOptions

    for i, p in enumerate(prompts):
        core.add_request(str(i), p, SamplingOptions(**options))
    tokens = {str(i): [] for i in range(len(prompts))}
    widths = {str(i): [] for i in range(len(prompts))}
    while core.has_work():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            widths[out.request_id] += [out.verify_width] * len(out.accept_lengths)
    return [tokens[str(i)] for i in range(len(prompts))], widths


@pytest.mark.parametrize("cheap", [0, 7])
def test_serving_engine_follows_the_cost_table(cheap):
    """A slot engine under adaptive speculation verifies no draft where the table says a
    plain step is cheaper, the whole block where speculation is; T = 0 tokens are AR's
    either way."""
    from dspine_jax.runtime.engine_core import EngineConfig, EngineCore

    target, drafter = build(kind="dspine", block=8)
    ar = AutoregressiveGenerator(target, eos_token_ids=[0])
    want = [g.tokens for g in generate_tokens(ar, PROMPTS[:4], max_new_tokens=16).generations]
    engine = SpeculativeEngine(target, drafter, eos_token_ids=[0], steps_per_call=2,
                               speculation=SpeculationConfig("adaptive"))
    engine.policy.costs = CostTable()     # not what earlier runs saved for this pair
    for rows in (1, 2, 4):         # a table where `cheap` is far the faster width
        for width in (0, 7):
            engine.policy.costs.set(rows, width, 1.0 if width == cheap else 100.0)
    core = EngineCore(engine, EngineConfig(max_slots=4, max_model_len=64,
                                           verify_widths=(0, 7)))
    assert core.stats().verify_widths == (0, 7) and core.stats().speculation == "adaptive"
    got, widths = serve_all(core, PROMPTS[:4], max_tokens=16)
    assert got == want
    used = {w for ws in widths.values() for w in ws}
    assert used == {cheap}


def test_a_programs_first_run_is_not_a_cost_sample(monkeypatch):
    """A program's first run pays one-time device setup: the engine does not time it, so
    a call shape run once teaches the policy nothing, and every later run can."""
    from dspine_jax.runtime.engine_core import EngineConfig, EngineCore
    from dspine_jax.runtime.runner import Runner

    target, drafter = build(kind="dspine", block=8)
    engine = SpeculativeEngine(target, drafter, eos_token_ids=[0], steps_per_call=2,
                               speculation=SpeculationConfig("adaptive"))
    engine.policy.costs = CostTable()
    runs, observed = [], []
    submit, observe = Runner.submit, engine.policy.observe_call

    def recording_submit(self, call):
        future = submit(self, call)
        if call.decode:
            runs.append((len(call.requests), call.width, call.first_run))
        return future

    def recording_observe(rows, width, seconds, passes, most=None):
        observed.append((rows, width))
        return observe(rows, width, seconds, passes, most)

    monkeypatch.setattr(Runner, "submit", recording_submit)
    monkeypatch.setattr(engine.policy, "observe_call", recording_observe)
    core = EngineCore(engine, EngineConfig(max_slots=4, max_model_len=64))
    core.warmup(modes=("greedy",))        # every program compiled before it first runs
    core.background_compile.result(300)
    while core.compiling:
        time.sleep(0.01)
    runs.clear()
    serve_all(core, PROMPTS[:4], max_tokens=16)
    serve_all(core, PROMPTS[4:8], max_tokens=16)
    assert any(first for _, _, first in runs) and observed
    for key in set(observed):
        later = sum(1 for r, w, first in runs if (r, w) == key and not first)
        assert observed.count(key) <= later, key
    once = {(r, w) for r, w, _ in runs if sum((r, w) == (a, b) for a, b, _ in runs) == 1}
    assert not once & set(observed)
    core.close()


def test_serving_warmup_teaches_the_policy_nothing():
    """Warm-up runs each program's first call (one-time device setup included) on a dummy
    prompt: neither its times nor its acceptance reach the policy; served requests do,
    once no program compiles beside them."""
    from dspine_jax.runtime.engine_core import EngineConfig, EngineCore

    target, drafter = build(kind="dspine", block=8)
    engine = SpeculativeEngine(target, drafter, eos_token_ids=[0], steps_per_call=2,
                               speculation=SpeculationConfig("adaptive"))
    engine.policy.costs = CostTable()
    prior = engine.policy.pool.alpha()
    core = EngineCore(engine, EngineConfig(max_slots=2, max_model_len=64))
    core.warmup(modes=("greedy",))
    assert engine.policy.costs.samples == {} and engine.policy.pool.alpha() == prior
    assert core.stats().speculation_costs == {}
    core.background_compile.result(300)
    while core.compiling:
        time.sleep(0.01)
    serve_all(core, PROMPTS[:2], max_tokens=12)
    assert engine.policy.costs.samples and engine.policy.pool.alpha() != prior
    # /health's view of the policy: ms per pass of what was measured, the pooled rates
    stats = core.stats().to_json()
    want = {}
    for (rows, width), seconds in engine.policy.costs.seconds.items():
        want.setdefault(str(rows), {})[str(width)] = round(seconds * 1e3, 3)
    assert stats["speculation_costs"] == want and want
    assert len(stats["acceptance"]) == 7


def test_served_costs_are_device_time_not_the_hosts_delays():
    """The engine thread reads a call's news whenever its host work allows (64 streams to
    feed, another thread holding the GIL): here every read comes 0.5 s late. The policy
    must learn what the device spent on each call, not the time between reads."""
    from dspine_jax.runtime.engine_core import EngineConfig, EngineCore

    target, drafter = build(kind="dspine", block=8)
    engine = SpeculativeEngine(target, drafter, eos_token_ids=[0], steps_per_call=2,
                               speculation=SpeculationConfig("adaptive"))
    engine.policy.costs = CostTable()
    core = EngineCore(engine, EngineConfig(max_slots=2, max_model_len=96))
    core.warmup(modes=("greedy",))
    core.background_compile.result(300)
    while core.compiling:
        time.sleep(0.01)
    read = core._runner.read

    def late_read(futures):
        time.sleep(0.5)
        return read(futures)

    core._runner.read = late_read
    before = core.stats().device_seconds
    serve_all(core, PROMPTS[:1], max_tokens=40)
    samples = [s for v in engine.policy.costs.samples.values() for s in v]
    # a call is 2 passes: a read 0.5 s late would make each pass cost >= 0.25 s
    assert len(samples) >= 3 and max(samples) < 0.1, samples
    # the device's wait for those reads is counted as idle, apart from its calls' time
    device = {k: v - before[k] for k, v in core.stats().device_seconds.items()}
    assert device["prefill"] > 0 and device["decode"] > 0
    assert device["idle"] >= 0.4 * (len(samples) - 1) > 2 * device["decode"], device


def test_a_seeded_sample_is_served_at_one_width():
    from dspine_jax.runtime.engine_core import EngineConfig, EngineCore

    target, drafter = build(kind="dspine", block=8)
    engine = SpeculativeEngine(target, drafter, eos_token_ids=[0], steps_per_call=2,
                               speculation=SpeculationConfig("adaptive"))
    engine.policy.costs = CostTable()
    for rows in (1, 2, 4):         # plain steps would be far cheaper
        engine.policy.costs.set(rows, 0, 1.0)
        engine.policy.costs.set(rows, 7, 100.0)
    alone, widths = serve_all(EngineCore(engine, EngineConfig(max_slots=4, max_model_len=64)),
                              PROMPTS[:1], max_tokens=16, temperature=1.0, seed=5)
    assert {w for ws in widths.values() for w in ws} == {7}
    crowd, _ = serve_all(EngineCore(engine, EngineConfig(max_slots=4, max_model_len=64)),
                         PROMPTS[:4], max_tokens=16, temperature=1.0, seed=5)
    assert crowd[0] == alone[0]


def test_offline_sampling_adapts_unless_seeded():
    """Offline prompts without a seed are sampled rows like any other: the policy gives them
    plain steps where the table says those are cheaper. With a seed every pass verifies
    the whole block, and the same seed gives the same text again."""
    target, drafter = build(kind="dspine", block=8)
    engine = SpeculativeEngine(target, drafter, eos_token_ids=[0], steps_per_call=2,
                               speculation=SpeculationConfig("adaptive"))
    engine.policy.costs = CostTable()
    for rows in (1, 2, 4):         # plain steps far cheaper
        engine.policy.costs.set(rows, 0, 1.0)
        engine.policy.costs.set(rows, 7, 100.0)
    kw = dict(max_new_tokens=16, temperature=1.0, ignore_eos=True)

    def widths(batch):
        return set().union(*(g.verify_widths for g in batch.generations))

    unseeded = generate_tokens(engine, PROMPTS[:2], **kw)
    assert widths(unseeded) == {0}
    seeded = generate_tokens(engine, PROMPTS[:2], seed=5, **kw)
    assert widths(seeded) == {7}
    again = generate_tokens(engine, PROMPTS[:2], seed=5, **kw)
    assert [g.tokens for g in again.generations] == [g.tokens for g in seeded.generations]


def test_info_speculation_costs(tiny_llama_dir, tiny_dspine_dir, tmp_path, monkeypatch):
    """`dspine info --speculation-costs` times every width, prints the width the policy
    picks (the fastest within its tolerance), and a later pipeline starts from the file."""
    from typer.testing import CliRunner

    from dspine_jax.api import Pipeline
    from dspine_cli.main import app

    monkeypatch.setenv("DSPINE_CACHE_DIR", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, [
        "info", "--speculation-costs", "--target", str(tiny_llama_dir), "--drafter",
        str(tiny_dspine_dir), "--batch-size", "1", "--batch-size", "2", "--acceptance", "0.9",
        "--dtype", "f32"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["acceptance"] == [0.9] * 3 and list(report["batch_sizes"]) == ["1", "2"]
    for row in report["batch_sizes"].values():
        assert set(row["ms_per_pass"]) == {"0", "1", "3"}
        rates = row["tokens_per_s"]
        assert rates[str(row["adaptive_width"])] >= 0.95 * max(rates.values())
        assert row["expected_tokens_per_pass"]["3"] == pytest.approx(1 + .9 + .81 + .729,
                                                                     abs=1e-3)
    pipe = Pipeline.load(str(tiny_llama_dir), str(tiny_dspine_dir), dtype="f32")
    assert str(pipe.decoder.policy_file()) == report["cost_file"]
    assert set(pipe.decoder.policy.costs.measured(2)) == {0, 1, 3}


def test_projection_picks_per_batch_from_measured_pass_times(tmp_path):
    """speculation_projection: tokens/s = B * E_k / c(B, k); a cheap block keeps the whole
    block, a costly one at batch 8 falls back to a narrower width."""
    from dspine_benchmarks import speculation_projection as sp

    alpha = [0.8] * 15
    steps = [{"method": "ar", "batch": b, "step_ms": 10.0} for b in (1, 8)]
    steps += [{"method": "dspine", "batch": 1, "verify_width": k, "step_ms": ms}
              for k, ms in ((0, 10.5), (3, 12.0), (15, 13.0))]
    steps += [{"method": "dspine", "batch": 8, "verify_width": k, "step_ms": ms}
              for k, ms in ((0, 10.5), (3, 14.0), (15, 40.0))]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (tmp_path / "p.json").write_text(json.dumps(alpha))
    sp.main(["--steps", str(tmp_path / "s.jsonl"), "--profile", str(tmp_path / "p.json"),
             "--out", str(tmp_path / "o.json")])
    one, eight = json.loads((tmp_path / "o.json").read_text())["rows"]
    assert one["adaptive_width"] == 15 and one["x_fixed"] == 1.0
    assert one["x_ar_fixed"] == pytest.approx(expected_tokens(alpha, 15) * 10 / 13, abs=1e-3)
    assert eight["adaptive_width"] == 3
    assert eight["x_fixed"] == pytest.approx(
        expected_tokens(alpha, 3) / 14 / (expected_tokens(alpha, 15) / 40), abs=1e-3)
