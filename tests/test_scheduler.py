"""The engine's scheduler on its own, with no JAX and no device: admission, chunked
prefill, page accounting, the passes of a call, preemption order, and how a call's news
end requests. A fake device answers each planned call with the news a real one returns
([rows, 3 + W + P]: tokens gained, passes, done, tokens, pass lengths)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from dspine_jax.errors import InputError
from dspine_jax.runtime import rows as row_fields
from dspine_jax.runtime.requests import QueueFull, SamplingOptions, merge_outputs
from dspine_jax.runtime.scheduler import MEASURING_PASSES, DecoderSpec, EngineConfig, Scheduler

EOS = 99
# an AR-like decoder: one position per pass, 4 passes per call alone, 2 when shared
SPEC = DecoderSpec(vocab_size=100, context=256, page_size=16, extra_capacity=0,
                   pass_positions=1, steps_per_call=4, shared_steps_per_call=2, eos=(EOS,),
                   news_width=(5, 4))


def scheduler(**kw) -> Scheduler:
    return Scheduler(SPEC, EngineConfig(**{"max_slots": 2, "max_model_len": 64, **kw}))


def options(max_tokens=8, **kw) -> SamplingOptions:
    return SamplingOptions(max_tokens=max_tokens, seed=0, **kw)


def news(call, gains: dict, spec: DecoderSpec = SPEC) -> np.ndarray:
    """The call's news: gains[request_id] = (tokens, done), one token per pass."""
    w, p = spec.news_width
    out = np.zeros((len(call.requests), 3 + w + p), np.int32)
    for i, r in enumerate(call.requests):
        if r is None or r.request_id not in gains:
            continue
        tokens, done = gains[r.request_id]
        passes = 0 if call.kind == "prefill" else len(tokens)
        out[i, :3] = len(tokens), passes, done
        out[i, 3:3 + len(tokens)] = tokens
        out[i, 3 + w:3 + w + passes] = 1
    return out


def step(s: Scheduler, gains=lambda call, r: ([7], False)):
    """Plan a step and answer every call at once: -> (calls, outputs by request id, one
    per request as the engine gives them)."""
    aborted, calls = s.schedule()
    outs = list(aborted)
    for call in calls:
        answer = {r.request_id: gains(call, r) for r in call.requests if r is not None}
        outs += s.receive(call, news(call, answer, s.spec))[0]
    return calls, {o.request_id: o for o in merge_outputs(outs)}


def test_the_scheduler_imports_no_jax():
    code = ("import sys; import dspine_jax.runtime.scheduler; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_admission_is_oldest_first_and_bounded_by_slots():
    s = scheduler()
    for name in "abc":
        s.add_request(name, [1, 2, 3], options())
    calls, outs = step(s)
    # the prompts complete in this chunk: they decode in the same step
    assert [c.kind for c in calls] == ["prefill", "decode"]
    assert [r.request_id for r in calls[0].requests if r] == ["a", "b"]
    assert [r.request_id for r in calls[1].requests if r] == ["a", "b"]
    assert outs["a"].new_token_ids == [7, 7]       # the first token, then a decode pass's
    assert s.num_waiting == 1 and s.num_running == 2
    calls, _ = step(s)
    assert [c.kind for c in calls] == ["decode"]
    assert [r.request_id for r in calls[0].requests if r] == ["a", "b"]


def test_a_long_prompt_prefills_in_chunks_while_others_decode():
    s = scheduler(prefill_chunk=16)
    s.add_request("long", list(range(1, 41)), options())
    s.add_request("short", [1, 2], options())
    chunks = []
    for _ in range(3):
        calls, _ = step(s)
        prefill = next(c for c in calls if c.kind == "prefill")
        q_len = row_fields.column(prefill.rows, row_fields.PREFILL_FIELDS, "q_len")
        chunks.append(int(q_len[0]))
        starting = [r.request_id for r in prefill.requests if r]
        # the long prompt starts decoding only with its last chunk
        assert ("long" in starting) == (len(chunks) == 3)
        if len(chunks) > 1:   # the short one decodes meanwhile
            assert any(c.kind == "decode" for c in calls)
    assert chunks == [16, 16, 8]


def test_a_call_holds_the_pages_its_passes_can_write():
    """One row alone runs the decoder's most passes, two rows the shared count; each
    request holds the pages for its cache plus the call's positions, and every page is
    free once both finish."""
    s = scheduler(max_model_len=64)
    s.add_request("a", [1] * 14, options(max_tokens=20))
    step(s)                 # prefill (14 positions, the first token), then a decode call
    calls, _ = step(s)
    assert calls[0].passes == SPEC.steps_per_call                 # alone: 4
    assert s.pages.held(0) == 2   # 14 + 4 positions of the call, + 4 of the next: 22
    s.add_request("b", [1, 2], options(max_tokens=3))
    calls, _ = step(s)
    decode = next(c for c in calls if c.decode)
    assert decode.passes == SPEC.shared_steps_per_call            # someone waits: 2
    for _ in range(20):
        if not s.has_work():
            break
        step(s, gains=lambda call, r: ([7] * max(1, call.passes),
                                       len(r.tokens) + max(1, call.passes) >= r.options.max_tokens))
    assert not s.has_work()
    assert s.pages.free_pages == s.pages.num_pages and s.used_tokens() == 0


def test_calls_that_measure_an_end_of_the_widths_are_short():
    """While adaptive speculation has not timed both ends of its widths at a batch size,
    a row decoding alone runs at most MEASURING_PASSES (its call runs a width to time it,
    not because it pays); once both are trusted, the decoder's most."""
    from dspine_jax.speculative.policy import SpeculationConfig, SpeculationPolicy

    # offline decoding: as many passes shared as alone
    spec = dataclasses.replace(SPEC, steps_per_call=8, shared_steps_per_call=8,
                               news_width=(9, 8))
    policy = SpeculationPolicy(SpeculationConfig("adaptive"), 4)     # widths 0, 1, 3
    s = Scheduler(spec, EngineConfig(max_slots=2, max_model_len=64), policy=policy,
                  widths=policy.widths)
    s.add_request("a", [1] * 14, options(max_tokens=40))
    step(s)
    calls, _ = step(s)
    assert calls[0].passes == MEASURING_PASSES == 4 and calls[0].width == 3
    assert policy.measuring(1) and not policy.measuring(2, (3,))
    policy.costs.set(1, 3, 1.3)
    assert policy.measuring(1)                       # the plain step is still to time
    policy.costs.set(1, 0, 1.0)
    assert not policy.measuring(1) and policy.measuring(2)
    step(s)                                          # planned before the costs were in
    calls, _ = step(s)
    assert calls[0].passes == spec.steps_per_call == 8


def test_a_prompt_decodes_in_the_step_its_last_chunk_is_prefilled():
    """The step that completes a prompt also decodes it, holding the pages of that call:
    alone and with nobody waiting, the decoder's most passes (4 here)."""
    s = scheduler(prefill_chunk=16, max_model_len=128)
    s.add_request("x", [1, 2], options(max_tokens=3))
    s.add_request("long", [1] * 46, options(max_tokens=8))

    def gains(call, r):
        n = max(1, call.passes)
        return [7] * n, len(r.tokens) + n >= r.options.max_tokens

    kinds = []
    for _ in range(3):          # x: prefilled and done in one step; long: 16, 16, 14
        calls, outs = step(s, gains)
        kinds.append([(c.kind, [r.request_id for r in c.requests if r]) for c in calls])
    assert kinds[0] == [("prefill", ["x"]), ("decode", ["x"])]
    assert kinds[1] == [("prefill", [])]
    assert kinds[2] == [("prefill", ["long"]), ("decode", ["long"])]
    assert calls[1].passes == SPEC.steps_per_call and outs.keys() == {"long"}
    [long] = s._running.values()
    # 46 positions and the call's 4: 4 pages of 16 (3 would hold 48)
    assert s.pages.held(long.slot) == 4 and long.cache_bound == 46 + 4


def test_the_newest_request_is_preempted_and_recomputed_from_its_tokens():
    """A pool of one full request: the newest running request gives its pages back and
    waits at the head of the queue; re-admitted, it prefills its prompt and every token
    it emitted but the last (the anchor)."""
    s = scheduler(max_slots=2, max_model_len=64, num_pages=4)
    s.add_request("old", [1] * 30, options(max_tokens=30))
    s.add_request("new", [2] * 30, options(max_tokens=30))
    streamed = []                              # what "new" returned, as a client saw it
    counter = iter(range(10, 90))

    def gains(call, r):                        # distinct tokens, "old" ends once preempted
        return [next(counter) for _ in range(max(1, call.passes))], \
            bool(s.preemptions) and r.request_id == "old"

    for _ in range(12):
        _, outs = step(s, gains)
        streamed += outs["new"].new_token_ids if "new" in outs else []
        if s.preemptions:
            break
    assert s.preemptions == 1 and s.num_waiting == 1
    [waiting] = list(s._waiting)
    assert waiting.request_id == "new" and waiting.slot == -1 and len(streamed) > 1
    while waiting.slot < 0:                    # "old" finishes, "new" comes back
        step(s, gains)
    assert waiting.fill == [2] * 30 + streamed[:-1]


def test_news_end_requests_on_eos_budget_and_stop_tokens():
    s = scheduler(max_slots=3)
    s.add_request("eos", [1], options())
    s.add_request("budget", [1], options(max_tokens=3))
    s.add_request("stop", [1], options(stop_token_ids=(42,)))
    step(s, gains=lambda call, r: ([7], False))
    gains = {"eos": ([8, EOS], True), "budget": ([8, 9], True), "stop": ([8, 42, 9], False)}
    _, outs = step(s, gains=lambda call, r: gains[r.request_id])
    assert {k: (o.finish_reason, o.new_token_ids) for k, o in outs.items()} == {
        "eos": ("stop", [8, EOS]), "budget": ("length", [8, 9]), "stop": ("stop", [8, 42])}
    assert not s.has_work() and s.pages.free_pages == s.pages.num_pages


def test_aborts_and_bad_requests():
    s = scheduler(max_waiting=1)
    s.add_request("a", [1], options())
    with pytest.raises(QueueFull):
        s.add_request("b", [1], options())
    with pytest.raises(InputError, match="already in the engine"):
        s.add_request("a", [1], options())
    with pytest.raises(InputError, match="outside the vocabulary"):
        s.check_request([100], options())
    with pytest.raises(InputError, match="Lower max_tokens to at most 60"):
        s.check_request([1] * 4, options(max_tokens=61))
    with pytest.raises(InputError, match="num_pages must be at least 4"):
        scheduler(num_pages=3)
    assert s.abort("a") and not s.abort("a")
    aborted, calls = s.schedule()
    assert [(o.request_id, o.finish_reason) for o in aborted] == [("a", "abort")]
    assert calls == [] and not s.has_work()


@pytest.mark.parametrize("bad, name", [
    (dict(max_slots=0), "max_slots"), (dict(max_slots=2.5), "max_slots"),
    (dict(max_model_len=-1), "max_model_len"), (dict(num_pages=0), "num_pages"),
    (dict(prefill_chunk=0), "prefill_chunk"), (dict(max_waiting=-1), "max_waiting"),
    (dict(verify_widths=(-1, 3)), "verify_widths"), (dict(max_slots=True), "max_slots")])
def test_engine_config_names_a_bad_value(bad, name):
    with pytest.raises(InputError, match=name):
        EngineConfig(**bad)


def test_scheduler_keeps_the_resolved_config():
    s = scheduler(max_model_len=None, max_slots=3)
    assert s.config.max_model_len == SPEC.context
    assert s.config.num_pages == 3 * -(-SPEC.context // SPEC.page_size)
    assert s.config.verify_widths is None and s.config.max_slots == 3
    with pytest.raises(InputError, match="num_pages must be at least"):
        scheduler(num_pages=1)


def test_calls_are_padded_to_powers_of_two_from_eight_rows():
    """From 8 rows on a call costs in proportion to its rows, so it is padded to the next
    power of 2, not of 4; chunks keep powers of 4."""
    assert row_fields.row_buckets(64) == [1, 4, 16, 64]
    assert row_fields.row_buckets(64, doubling_from=8) == [1, 4, 8, 16, 32, 64]
    assert row_fields.row_buckets(8, doubling_from=8) == [1, 4, 8]
    assert row_fields.row_buckets(100, doubling_from=8) == [1, 4, 8, 16, 32, 64, 100]
    s = Scheduler(SPEC, EngineConfig(max_slots=64, max_model_len=64, prefill_chunk=512))
    assert s.row_sizes == [1, 4, 8, 16, 32, 64]
    assert s.chunk_sizes == [16, 64]      # the context leaves room for 64 tokens at most
