"""The serving front end keeps its promises: the engine core equals offline generation, the
HTTP server answers the OpenAI protocol under load, frees slots of clients that leave,
refuses bad requests with 4xx and overload with 429 and keeps serving, shuts down
gracefully, and starts again after a kill.

One tiny random Llama (tests/conftest.py) with a tiny DSpine drafter serves every
in-process test; the restart test runs `dspine serve` (AR) as a subprocess. Every request
goes to 127.0.0.1, and every loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from dspine_jax.api import Pipeline  # noqa: E402
from dspine_jax.checkpoints import load_target  # noqa: E402
from dspine_jax.errors import InputError  # noqa: E402
from dspine_jax.speculative.policy import SpeculationConfig  # noqa: E402
from dspine_serve.detokenizer import IncrementalDetokenizer  # noqa: E402
from dspine_jax.runtime.engine_core import EngineConfig, EngineCore, SamplingOptions  # noqa: E402
from dspine_jax.runtime.offline import generate_tokens  # noqa: E402
from dspine_serve.server import DrainingServer, build  # noqa: E402
from pallas_kernels.switches import Switches  # noqa: E402

SLOTS = 8
CONTEXT = 256
PLAIN = ["the quick brown fox", "hello world", "def f(x):", "the lazy dog", "over the",
         "jumps over the lazy dog", "brown fox hello", "world def"]
CHAT = ["hello", "what is the quick fox?", "def f(x): return x", "say hello world",
        "the dog", "fox", "jumps", "lazy brown dog jumps"]


def free_port(count: int = 1) -> int:
    """A port free now, with the `count - 1` ports after it."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for p in range(port + 1, port + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue


@pytest.fixture(scope="module")
def pipe(tiny_llama_dir, tiny_dspine_dir) -> Pipeline:
    # fixed widths: served and offline rows then run the same passes (adaptive serving:
    # tests/test_speculation.py)
    return Pipeline.from_loaded(load_target(tiny_llama_dir, dtype="f32"), tiny_dspine_dir,
                                serving=True, speculation=SpeculationConfig("fixed"))


@pytest.fixture(scope="module")
def offline(pipe) -> dict:
    """Pipeline.generate's T = 0 results (24 tokens) for every test prompt: the reference."""
    refs = {("plain", i): r for i, r in enumerate(pipe.generate(PLAIN, max_new_tokens=24))}
    return refs | {("chat", i): r for i, r in enumerate(pipe.generate(CHAT, chat=True,
                                                                       max_new_tokens=24))}


def drain(core: EngineCore, out: dict | None = None, limit: int = 2000) -> dict:
    """Step until idle; {request_id: (tokens, finish_reason, accept_lengths)}, added to
    `out` (what earlier steps returned)."""
    out = {} if out is None else out
    for _ in range(limit):
        if not core.has_work():
            return out
        gather(core.step(), out)
    raise AssertionError(f"the engine still has work after {limit} steps")


def gather(outputs, out: dict) -> dict:
    for o in outputs:
        tokens, _, accepted = out.get(o.request_id, ([], None, []))
        out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason,
                             accepted + o.accept_lengths)
    return out


# ----- the engine core ---------------------------------------------------------------------
def test_engine_core_equals_offline_generate(pipe, offline):
    """More requests than slots, each with its own max_tokens: rows are admitted as others
    finish, and every row equals Pipeline.generate token for token (acceptance too)."""
    core = EngineCore(pipe.decoder, EngineConfig(max_slots=SLOTS, max_model_len=CONTEXT))
    prompts = PLAIN + PLAIN[:4]
    budgets = [24, 5, 17, 1, 24, 9, 12, 24, 3, 24, 20, 7]
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        core.add_request(f"r{i}", pipe.encode(p), SamplingOptions(max_tokens=n))
    assert core.stats().waiting == len(prompts)
    got = drain(core)
    reference = [offline[("plain", i % 8)] for i in range(len(prompts))]
    for i, (ref, n) in enumerate(zip(reference, budgets)):
        tokens, reason, accepted = got[f"r{i}"]
        assert tokens == ref.tokens[:n]
        assert reason == ("stop" if ref.finish_reason == "stop" and len(ref.tokens) <= n
                          else "length")
        assert sum(accepted) == len(tokens) - 1
        if n == 24:
            assert accepted == ref.accept_lengths
    stats = core.stats()
    assert (stats.running, stats.waiting, stats.used_tokens) == (0, 0, 0)
    assert stats.free_pages == stats.num_pages and stats.preemptions == 0


def test_engine_core_reads_a_step_while_the_next_is_queued(pipe, offline, monkeypatch):
    """The host reads a step's news only once the next step's calls are on the device's
    queue (the device never waits for the host while requests decode), the run still
    equals offline generation, and a finished row's extra call leaves its pages free."""
    from dspine_jax.runtime import runner

    core = EngineCore(pipe.decoder, EngineConfig(max_slots=2, max_model_len=CONTEXT))
    queued, reads = [], []
    real_queue = core._queue_step

    def queue_step():
        outputs, made = real_queue()
        queued.append(made)
        return outputs, made

    real_get = runner.jax.device_get

    def device_get(x):
        reads.append(sum(queued))          # steps queued when this read began
        return real_get(x)

    monkeypatch.setattr(core, "_queue_step", queue_step)
    monkeypatch.setattr(runner.jax, "device_get", device_get)
    core.add_request("a", pipe.encode(PLAIN[0]), SamplingOptions(max_tokens=24))
    core.add_request("b", pipe.encode(PLAIN[1]), SamplingOptions(max_tokens=24))
    got = drain(core)
    monkeypatch.undo()
    assert got["a"][0] == offline[("plain", 0)].tokens
    assert got["b"][0] == offline[("plain", 1)].tokens
    # the i-th read (step i) starts with step i + 1 queued, but for the last one or two
    # (when nothing was left to queue)
    ahead = [n - i for i, n in enumerate(reads, start=1)]
    assert len(reads) >= 4 and all(a >= 1 for a in ahead[:-2]), ahead
    assert core.stats().free_pages == core.num_pages and not core.has_work()


def test_a_row_alone_runs_the_longest_calls(pipe):
    """The slot engine runs the decoder's most passes per call while one row decodes alone,
    and its shared count while several do (the news show each call's passes)."""
    ar = Pipeline.from_loaded(pipe.target, serving=True)
    decoder = ar.decoder
    assert (decoder.steps_per_call, decoder.shared_steps_per_call) == (16, 8)

    def passes_per_call(prompts):
        core = EngineCore(decoder, EngineConfig(max_slots=2, max_model_len=CONTEXT))
        for i, p in enumerate(prompts):
            core.add_request(str(i), ar.encode(p), SamplingOptions(max_tokens=40,
                                                                   ignore_eos=True))
        calls = set()
        while core.has_work():
            calls |= {len(o.accept_lengths) for o in core.step() if o.accept_lengths}
        return calls

    # 40 tokens: the first from the prefill, then 16 + 16 + 7 passes (or 8 + 8 + ...)
    assert passes_per_call(PLAIN[:1]) == {16, 7}
    assert max(passes_per_call(PLAIN[:2])) == 8


def test_first_tokens_are_handed_over_before_the_decode_call_behind_them(pipe, offline):
    """A request decodes in the step that prefills it; with `on_first_tokens` that step's
    prefill news are read alone and handed over first (a server streams the first token
    without waiting for the decode call), the decode call's come back from `step`, and
    together they are the offline tokens."""
    core = EngineCore(pipe.decoder, EngineConfig(max_slots=SLOTS, max_model_len=CONTEXT))
    ref = offline[("plain", 0)].tokens[:12]
    reads, early = [], []
    real_read = core._runner.read

    def read(futures):
        reads.append(len(futures))
        return real_read(futures)

    core._runner.read = read
    core.add_request("a", pipe.encode(PLAIN[0]), SamplingOptions(max_tokens=12))
    handed = lambda outs: early.append((list(reads), outs))  # noqa: E731
    assert core.step(on_first_tokens=handed) == [] and reads == []    # prefill + decode
    late = core.step(on_first_tokens=handed)
    [(read_before, [first])] = early
    assert read_before == [1] and reads[:2] == [1, 1]   # the prefill's news, then decode's
    assert first.new_token_ids == ref[:1] and not first.accept_lengths
    got = gather(late, {"a": (first.new_token_ids, None, [])})
    got = drain(core, got)
    assert got["a"][0] == ref and len(early) == 1


def test_engine_core_abort_stop_tokens_and_checks(pipe, offline):
    core = EngineCore(pipe.decoder, EngineConfig(max_slots=SLOTS, max_model_len=CONTEXT))
    ids = pipe.encode(PLAIN[0])
    ref = offline[("plain", 0)]
    stop = ref.tokens[5]
    cut = ref.tokens.index(stop)
    core.add_request("stop", ids, SamplingOptions(max_tokens=12, stop_token_ids=(stop,)))
    for i in range(SLOTS - 1):   # fill the other slots: the next request waits
        core.add_request(f"long{i}", ids, SamplingOptions(max_tokens=200, ignore_eos=True))
    core.add_request("queued", ids, SamplingOptions(max_tokens=4))
    # a step's tokens come back on the next step (the device runs ahead of the host)
    first = gather(core.step(), {})
    assert first == {}
    first = gather(core.step(), first)
    # the first step prefilled every prompt and decoded them in one call: the first
    # token and that call's
    assert all(len(first[f"long{i}"][0]) > 1 for i in range(SLOTS - 1))
    assert core.stats().running == SLOTS and core.stats().waiting == 1
    assert core.abort("queued") and not core.abort("unknown")
    assert all(core.abort(f"long{i}") for i in range(SLOTS - 1))
    assert not core.abort("long0")
    got = drain(core, first)
    assert got["stop"][:2] == (ref.tokens[:cut + 1], "stop")
    assert got["long0"][1] == "abort" and 0 < len(got["long0"][0]) < 200
    assert got["queued"] == ([], "abort", [])
    assert core.stats().running == 0 and core.stats().free_slots == SLOTS
    for ids_, options in [(ids * 100, SamplingOptions()), ([], SamplingOptions()),
                          (ids, SamplingOptions(max_tokens=0)),
                          (ids, SamplingOptions(max_tokens=CONTEXT)),
                          (ids, SamplingOptions(temperature=-1.0)),
                          ([10 ** 6], SamplingOptions())]:
        with pytest.raises(InputError):
            core.add_request("bad", ids_, options)
    assert not core.has_work()


def test_seeded_request_is_the_same_alone_and_under_load(pipe):
    """Each slot has its own RNG key: a seeded request does not depend on its neighbours."""
    core = EngineCore(pipe.decoder, EngineConfig(max_slots=SLOTS, max_model_len=CONTEXT))
    options = SamplingOptions(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    ids = pipe.encode(PLAIN[1])
    core.add_request("alone", ids, options)
    alone = drain(core)["alone"][0]
    for i in range(11):  # neighbours: sampled, unseeded, and more of them than slots
        core.add_request(f"n{i}", pipe.encode(PLAIN[i % 8]),
                         SamplingOptions(max_tokens=5 + i, temperature=1.0))
    core.add_request("loaded", ids, options)
    assert drain(core)["loaded"][0] == alone


def test_decode_calls_are_compiled_per_sampling_mode(pipe, monkeypatch):
    """A decode call's key carries what its rows ask of the sampler: sampled rows without
    top-p/top-k run the program with no vocabulary threshold, one filtering row (or
    the warp_unfiltered switch off) the general one; a seeded request's tokens equal offline
    generate's with its seed either way."""
    modes = []
    core = EngineCore(pipe.decoder, EngineConfig(max_slots=SLOTS, max_model_len=CONTEXT))
    spy = core._runner.sampling_mode
    monkeypatch.setattr(core._runner, "sampling_mode",
                        lambda m: modes.append(spy(m)) or modes[-1])
    ids = pipe.encode(PLAIN[2])
    offline = generate_tokens(pipe.decoder, [ids], max_new_tokens=12, temperature=1.0, seed=7,
                                    ignore_eos=True).generations[0].tokens
    plain = SamplingOptions(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    core.add_request("plain", ids, plain)
    core.add_request("greedy", ids, SamplingOptions(max_tokens=12, top_p=0.5, top_k=3))
    assert drain(core)["plain"][0] == offline
    assert set(modes) == {"unfiltered"}
    modes.clear()
    core.add_request("plain", ids, plain)
    core.add_request("filtering", ids, SamplingOptions(max_tokens=4, temperature=1.0,
                                                       top_p=0.9))
    assert drain(core)["plain"][0] == offline
    assert modes[0] == "filtered" and modes[-1] == "unfiltered"
    # a decoder's switches are fixed when it is built (DSPINE_WARP_UNFILTERED=0 then)
    monkeypatch.setattr(pipe.decoder, "switches", Switches(warp_unfiltered=False))
    modes.clear()
    core.add_request("plain", ids, plain)
    assert drain(core)["plain"][0] == offline and set(modes) == {"filtered"}


@pytest.fixture(scope="module")
def ar(pipe) -> Pipeline:
    """The target alone: AR greedy is the independent T = 0 reference."""
    return Pipeline.from_loaded(pipe.target)


LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)   # > 100 tokens


def test_admission_waits_for_pages_not_only_slots(pipe, ar):
    """A pool of one full-length request's pages: long prompts are admitted as pages free
    up, not as slots do; every output equals AR greedy, and every page comes back."""
    per_slot = CONTEXT // pipe.decoder.page_size
    core = EngineCore(pipe.decoder, EngineConfig(max_slots=SLOTS, max_model_len=CONTEXT,
                      num_pages=per_slot))
    prompts = [pipe.encode(LONG + " " + w) for w in ("a", "b", "c", "d")]
    assert all(len(p) > 100 for p in prompts)
    for i, ids in enumerate(prompts):
        core.add_request(f"r{i}", ids, SamplingOptions(max_tokens=16))
    first = gather(core.step(), {})
    stats = core.stats()
    assert stats.running < 4 and stats.waiting > 0 and stats.free_slots > 0, stats
    got = drain(core, first)
    reference = generate_tokens(ar.decoder, prompts, max_new_tokens=16).generations
    for i, ref in enumerate(reference):
        assert got[f"r{i}"][0] == ref.tokens, i
    stats = core.stats()
    assert stats.free_pages == stats.num_pages == per_slot and stats.used_tokens == 0
    with pytest.raises(InputError, match="num_pages"):
        EngineCore(pipe.decoder, EngineConfig(max_slots=2, max_model_len=CONTEXT,
                                              num_pages=per_slot - 1))


def test_chunked_prefill_equals_offline_and_interleaves_with_decoding(pipe, ar):
    """A prompt of 7 chunks prefills over 7 steps while a running request keeps decoding;
    its output equals offline generate and AR greedy."""
    core = EngineCore(pipe.decoder, EngineConfig(max_slots=SLOTS, max_model_len=CONTEXT,
                                                 prefill_chunk=16))
    long_ids = pipe.encode(LONG)
    assert 96 < len(long_ids) <= 112
    core.add_request("short", pipe.encode(PLAIN[0]), SamplingOptions(max_tokens=120,
                                                                     ignore_eos=True))
    got = gather(core.step(), {})                     # short: prefill and decode queued
    got = gather(core.step(), got)                    # their tokens read
    assert len(got["short"][0]) > 1
    core.add_request("long", long_ids, SamplingOptions(max_tokens=24))
    steps_before_first_token = 0
    while "long" not in got:
        before = len(got["short"][0])
        gather(core.step(), got)
        steps_before_first_token += 1
        assert len(got["short"][0]) > before          # decoding went on meanwhile
    assert steps_before_first_token == 8      # 7 chunks; the 7th's news read one step later
    got = drain(core, got)
    offline = pipe.generate([LONG], max_new_tokens=24)[0]
    assert got["long"][0] == offline.tokens
    assert got["long"][0] == generate_tokens(ar.decoder, [long_ids], max_new_tokens=24
                                                 ).generations[0].tokens
    assert core.stats().free_pages == core.num_pages


@pytest.mark.parametrize("method", ["dspine", "ar"])
def test_preemption_recomputes_requests_without_changing_them(pipe, ar, method):
    """A pool far too small for every request at once (16 pages; the requests need 40 at
    their end): the newest are preempted and recomputed, and still every T = 0 output
    equals AR greedy, a seeded sampled request equals itself alone, nothing is emitted
    twice, and every page comes back."""
    decoder = pipe.decoder if method == "dspine" else ar.decoder
    per_slot = CONTEXT // decoder.page_size
    prompts = [pipe.encode(p) for p in PLAIN]
    sampled = SamplingOptions(max_tokens=40, temperature=0.8, seed=99, ignore_eos=True)

    alone = EngineCore(decoder, EngineConfig(max_slots=SLOTS, max_model_len=CONTEXT))
    alone.add_request("s", prompts[1], sampled)
    alone_tokens = drain(alone)["s"][0]

    core = EngineCore(decoder, EngineConfig(max_slots=SLOTS, max_model_len=CONTEXT,
                                            num_pages=per_slot))
    for i, ids in enumerate(prompts):
        core.add_request(f"r{i}", ids, SamplingOptions(max_tokens=60, ignore_eos=True))
    core.add_request("s", prompts[1], sampled)
    got, peak = {}, 0
    for _ in range(2000):
        if not core.has_work():
            break
        gather(core.step(), got)
        peak = max(peak, core.num_pages - core.stats().free_pages)
    assert core.stats().preemptions > 0 and peak <= per_slot
    reference = generate_tokens(ar.decoder, prompts, max_new_tokens=60, ignore_eos=True).generations
    for i, ref in enumerate(reference):
        tokens, reason, _ = got[f"r{i}"]
        assert (tokens, reason) == (ref.tokens, "length"), i
    assert got["s"][0] == alone_tokens and len(alone_tokens) == 40
    stats = core.stats()
    assert (stats.running, stats.waiting, stats.free_pages) == (0, 0, per_slot)


def test_detokenizer_holds_back_stop_strings_and_partial_characters(pipe):
    tok = pipe.tokenizer
    text = "hello world the quick brown fox"
    ids = tok.encode(text)
    for stop, expected in [((), text), (("quick",), "hello world the "),
                           (("o w", "zzz"), "hell"), (("x",), "hello world the quick brown fo")]:
        d = IncrementalDetokenizer(tok, stop=stop)
        pieces = [d.add([t]) for t in ids] + [d.add([], last=True)]
        assert "".join(pieces) == expected == d.text
        assert d.stopped == bool(stop and stop[0] in text)
    d = IncrementalDetokenizer(tok)
    euro = tok.encode("\u20ac")  # three bytes, one byte-level token each
    assert len(euro) > 1 and d.add(euro[:1]) == "" and d.add(euro[1:]) == "\u20ac"
    # Cut inside a character, the finished text ends before it, not in U+FFFD; a U+FFFD
    # the model wrote stays.
    d = IncrementalDetokenizer(tok)
    assert d.add(tok.encode("ok ") + euro[:2], last=True) == "ok " == d.text
    replacement = tok.encode("\ufffd")
    d = IncrementalDetokenizer(tok)
    assert d.add(tok.encode("ok") + replacement, last=True) == "ok\ufffd"
    # Random ids (special tokens, stray bytes) in random bursts: the pieces join into
    # decode(all ids) less an unfinished last character, decode_complete(all ids).
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        d, pieces, i = IncrementalDetokenizer(tok), [], 0
        while i < len(ids):
            k = rng.randrange(1, 5)
            pieces.append(d.add(ids[i:i + k], last=i + k >= len(ids)))
            i += k
        assert "".join(pieces) == d.text == tok.decode_complete(ids)


# ----- the HTTP server -----------------------------------------------------------------------
class Served:
    """uvicorn in a thread on 127.0.0.1 (a free port), over an app from `build`."""

    def __init__(self, pipe, *, max_queue=64, grace=30.0, **options):
        self.app, self.engine = build(pipe, EngineConfig(max_slots=SLOTS, max_model_len=CONTEXT),
                                      model_name="tiny", max_queue=max_queue, **options)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                log_level="warning", timeout_graceful_shutdown=grace)
        self.server = DrainingServer(config, self.engine)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "no server"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def served(pipe):
    s = Served(pipe)
    yield s
    s.stop()


@contextlib.contextmanager
def slow_engine(engine, seconds=0.03):
    """Each engine step takes at least `seconds`: requests stay in flight long enough to
    disconnect or shut down mid-stream on a fast machine."""
    core = engine.core
    step = core.step

    def slow(**kwargs):
        time.sleep(seconds)
        return step(**kwargs)

    core.step = slow
    try:
        yield
    finally:
        del core.step


def wait_idle(url, timeout=15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(url + "/health", timeout=5).json()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, f"slots still busy: {stats}"
        time.sleep(0.05)


async def stream_request(client, path, body) -> tuple[str, str, dict]:
    """(text, finish_reason, usage) of one streaming request."""
    text, reason, usage = [], None, None
    async with client.stream("POST", path, json={**body, "stream": True,
                                                 "stream_options": {"include_usage": True}}
                             ) as r:
        assert r.status_code == 200, await r.aread()
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        if chunk.get("usage"):
            assert chunk["choices"] == []
            usage = chunk["usage"]
            continue
        [choice] = chunk["choices"]
        text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
        reason = choice["finish_reason"] or reason
    return "".join(text), reason, usage


def test_64_concurrent_streaming_clients_match_offline(pipe, offline, served):
    """Every T = 0 response equals Pipeline.generate's text for its prompt; none is lost or
    duplicated; the usage chunk counts the tokens; all slots are free afterwards."""
    budgets = (24, 11)
    jobs = [(kind, i, n) for kind in ("plain", "chat") for i in range(8) for n in budgets]
    jobs = [job for job in jobs for _ in range(2)]  # 64 requests, each prompt 4 times
    assert len(jobs) == 64
    refs = offline

    async def one(client, kind, i, n):
        if kind == "plain":
            return await stream_request(client, "/v1/completions", {
                "model": "tiny", "prompt": PLAIN[i], "max_tokens": n, "temperature": 0})
        return await stream_request(client, "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": CHAT[i]}],
            "max_tokens": n, "temperature": 0})

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=served.url, timeout=60, limits=limits,
                                     trust_env=False) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, *job) for job in jobs)), timeout=180)

    results = asyncio.run(main())
    assert len(results) == 64
    for (kind, i, n), (text, reason, usage) in zip(jobs, results):
        ref = refs[(kind, i)]
        tokens = ref.tokens[:n]
        # (a character the budget cuts is left out, not sent as U+FFFD)
        assert text == pipe.tokenizer.decode_complete(tokens), (kind, i, n)
        assert usage["completion_tokens"] == len(tokens)
        assert usage["prompt_tokens"] == ref.prompt_tokens
        assert reason == ("stop" if ref.finish_reason == "stop" and len(ref.tokens) <= n
                          else "length")
        assert usage["target_passes"] >= 1 and usage["mean_accept_length"] >= 1
    stats = wait_idle(served.url)
    assert stats["free_slots"] == SLOTS and stats["used_tokens"] == 0
    assert stats["free_pages"] == stats["num_pages"] == SLOTS * CONTEXT // 16
    # what runs: the pipeline's decoder, as built (fixed speculation, the CPU's backend)
    assert stats["runtime"] == pipe.runtime.to_json()
    assert (stats["runtime"]["method"], stats["runtime"]["attention_backend"],
            stats["runtime"]["speculation"]["speculation"]) == ("dspine", "xla", "fixed")
    assert {k: stats["engine"][k] for k in ("max_slots", "max_model_len", "num_pages")} == {
        "max_slots": SLOTS, "max_model_len": CONTEXT, "num_pages": stats["num_pages"]}
    assert stats["engine"]["verify_widths"] == list(stats["verify_widths"])
    metrics = httpx.get(served.url + "/metrics").text
    assert "dspine_accept_length_count" in metrics
    assert "dspine_time_to_first_token_seconds_count" in metrics
    # the device's seconds by call, the same in /metrics as in /health
    device = {m[0]: float(m[1]) for m in re.findall(
        r'^dspine_device_seconds_total\{call="(\w+)"\} (\S+)$', metrics, re.M)}
    assert device.keys() == {"prefill", "decode", "idle"} and device["decode"] > 0
    health = httpx.get(served.url + "/health").json()["device_seconds"]
    assert all(abs(health[k] - device[k]) < 1e-3 for k in device), (health, device)


def test_seeded_http_request_same_alone_and_under_load(served):
    body = {"prompt": "hello world", "max_tokens": 16, "temperature": 1.0, "seed": 7}

    async def main():
        async with httpx.AsyncClient(base_url=served.url, timeout=60,
                                     trust_env=False) as client:
            alone = (await client.post("/v1/completions", json=body)).json()
            noise = [client.post("/v1/completions", json={
                "prompt": p, "max_tokens": 12, "temperature": 1.0}) for p in PLAIN * 2]
            responses = await asyncio.wait_for(asyncio.gather(
                *noise[:9], client.post("/v1/completions", json=body), *noise[9:]), 120)
            return alone, responses[9].json()

    alone, loaded = asyncio.run(main())
    assert alone["choices"][0]["text"] == loaded["choices"][0]["text"]
    assert alone["usage"]["completion_tokens"] == 16


def test_disconnect_mid_stream_frees_the_slot(served):
    """A streaming client that closes its connection, and a non-streaming one that gives
    up, both abort their requests: every slot is free again."""
    body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    with slow_engine(served.engine, seconds=0.1):   # 200 tokens: 13 steps of 16 passes
        with httpx.Client(base_url=served.url, timeout=30, trust_env=False) as client:
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                for _ in r.iter_lines():
                    break                       # one chunk, then hang up
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.url + "/v1/completions", json=body, timeout=0.5)
        stats = wait_idle(served.url)
    assert stats["free_pages"] == stats["num_pages"]       # the page count back to full
    metrics = httpx.get(served.url + "/metrics").text
    aborted = [line for line in metrics.splitlines()
               if line.startswith('dspine_requests_total{finish_reason="abort"}')]
    assert aborted and float(aborted[0].split()[-1]) >= 2, metrics


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 10 ** 6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": CONTEXT}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi " * 300}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": 7}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2.5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "seed": 2 ** 70}, 400, "seed"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 300}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 10 ** 6}, 400, "max_completion_tokens"),
]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(served):
    with httpx.Client(base_url=served.url, timeout=30, trust_env=False) as client:
        for path, body, status, param in BAD:
            r = (client.post(path, content=body, headers={"content-type": "application/json"})
                 if isinstance(body, bytes) else client.post(path, json=body))
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            assert error["param"] == param, (body, error)
        r = client.post("/v1/completions", content=b'{"prompt": "' + b"x" * (5 << 20) + b'"}')
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert client.get("/v1/nothing").status_code == 404
        assert client.get("/v1/completions").status_code == 405
        assert "error" in client.get("/v1/nothing").json()
        r = client.post("/v1/chat/completions", json={   # greedy: a sample may end at EOS
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert wait_idle(served.url)["free_slots"] == SLOTS


def test_stop_strings_cut_the_text_and_free_the_slot(offline, served):
    text = offline[("plain", 2)].text
    # An ASCII stop string (the random model also writes partial characters), first seen
    # past the start of the text.
    stop = next(text[i:i + k] for k in (2, 1) for i in range(3, len(text) - k)
                if text[i:i + k].isascii() and text[i:i + k].isalnum()
                and text.find(text[i:i + k]) == i)
    r = httpx.post(served.url + "/v1/completions", json={
        "prompt": PLAIN[2], "max_tokens": 24, "temperature": 0, "stop": [stop]}).json()
    assert r["choices"][0]["text"] == text[:text.find(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"
    wait_idle(served.url)


def test_openai_client_over_a_real_socket(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60, http_client=httpx.Client(trust_env=False))
    assert [m.id for m in client.models.list().data] == ["tiny"]
    completion = client.completions.create(model="tiny", prompt="hello", max_tokens=6,
                                           temperature=0)
    assert completion.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
    assert chunks[-2].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_overload_gets_429_and_the_server_recovers(pipe):
    s = Served(pipe, max_queue=2)   # 8 slots + 2 waiting: the eleventh request is refused
    try:
        body = {"prompt": "hi", "max_tokens": 150, "ignore_eos": True, "temperature": 0}

        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=60,
                                         limits=httpx.Limits(max_connections=32),
                                         trust_env=False) as client:
                return await asyncio.wait_for(asyncio.gather(
                    *(client.post("/v1/completions", json=body) for _ in range(24))), 120)

        with slow_engine(s.engine):
            codes = sorted(r.status_code for r in asyncio.run(main()))
        assert codes.count(200) >= SLOTS + 2 and codes.count(429) >= 1, codes
        assert set(codes) == {200, 429}
        wait_idle(s.url)
        assert httpx.post(s.url + "/v1/completions", json=body).status_code == 200
    finally:
        s.stop()


def test_shutdown_finishes_in_flight_requests_and_refuses_new_ones(pipe):
    """What SIGTERM does (uvicorn calls handle_exit from its signal handler)."""
    s = Served(pipe)
    try:
        with slow_engine(s.engine):
            with httpx.Client(base_url=s.url, timeout=30, trust_env=False) as client:
                body = {"prompt": "hi", "max_tokens": 60, "ignore_eos": True, "stream": True,
                        "temperature": 0}
                with client.stream("POST", "/v1/completions", json=body) as r:
                    lines = r.iter_lines()
                    next(lines)
                    s.server.handle_exit(signal.SIGTERM, None)
                    # 503 until uvicorn stops listening; then a connection is refused, or
                    # closed unanswered if it raced the listener's close.
                    try:
                        refused = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"},
                                             timeout=5, trust_env=False).status_code
                    except (httpx.ConnectError, httpx.RemoteProtocolError):
                        refused = "refused"
                    rest = [line for line in lines if line]
        assert refused in (503, "refused")
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        s.thread.join(30)
        assert not s.thread.is_alive() and not s.engine.alive
    finally:
        s.stop()


def test_shutdown_cancels_what_outlives_the_grace_period(pipe):
    s = Served(pipe, grace=0.5)
    try:
        with slow_engine(s.engine, seconds=0.1):
            with httpx.Client(base_url=s.url, timeout=30, trust_env=False) as client:
                body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True,
                        "stream": True}
                with client.stream("POST", "/v1/completions", json=body) as r:
                    lines = r.iter_lines()
                    next(lines)
                    t0 = time.monotonic()
                    s.server.handle_exit(signal.SIGTERM, None)
                    with contextlib.suppress(httpx.HTTPError):
                        rest = [line for line in lines if line]
                        assert "data: [DONE]" not in rest    # cut, not finished
        s.thread.join(30)
        assert not s.thread.is_alive() and time.monotonic() - t0 < 10
        assert not s.engine.alive and s.engine.stats().running == 0
    finally:
        s.stop()


def test_bench_serve_cli(served, tmp_path):
    from typer.testing import CliRunner

    from dspine_cli.main import app

    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "hi " * 300, "chat": False}]    # too long: skipped, as bench_serving
    lines += [{"prompt": p, "chat": i % 2 == 0} for i, p in enumerate(PLAIN)]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, [
        "bench", "serve", "--base-url", served.url, "--prompts", str(prompts),
        "--num-prompts", "8", "--concurrency", "1", "4", "--max-tokens", "8",
        "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "results.json").read_text())
    assert [lv["concurrency"] for lv in saved["levels"]] == [1, 4]
    assert saved["skipped_long_prompts"] == 1
    for level in saved["levels"]:
        assert level["completed"] == 8 and level["failed"] == 0
        # the server's device over the level, from its /metrics
        assert level["device_decode_s"] > 0 and level["device_prefill_s"] > 0
        assert 0 < level["device_decode_share"] + level["device_prefill_share"] <= 1.05
        assert level["total_output_tokens"] == 64 and level["output_throughput"] > 0
        assert level["accept_length"] >= 1 and level["accept_length_metrics"] >= 1
        assert level["median_ttft_ms"] > 0
        # every pass after the first tokens, at the widths the server verified
        passes = level["passes_by_verify_width"]
        assert sum(passes.values()) == round((64 - 8) / level["accept_length"])
    assert (out / "results.png").stat().st_size > 0
    refused = CliRunner().invoke(app, ["bench", "serve", "--base-url", "http://10.1.2.3:80"])
    assert refused.exit_code == 2 and "loopback" in refused.output


def test_bench_serve_duration_is_a_soak(served, tmp_path):
    """--duration cycles 3 prompts for 3 s with 2 clients: more requests than prompts
    complete, none fail, and the server's slots and pages are all free afterwards."""
    from dspine_serve.bench import bench_serve

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PLAIN[:3]))
    result = bench_serve(served.url, prompts=str(prompts), num_prompts=3,
                         concurrency=[2], max_tokens=4, duration=3.0, log=lambda _: None)
    (level,) = result["levels"]
    assert level["failed"] == 0 and level["completed"] > 3
    assert level["duration_s"] >= 3.0 and level["total_output_tokens"] == 4 * level["completed"]
    stats = served.engine.stats()
    assert stats.running == 0 and stats.waiting == 0 and stats.free_pages == stats.num_pages
    with pytest.raises(InputError, match="--duration"):
        bench_serve(served.url, prompts=str(prompts), num_prompts=3, duration=0)


def test_api_key_guards_every_route_but_health(pipe):
    """With an API key: the official client with the key is served, with a wrong one or
    none it gets 401 and an OpenAI error body; /health stays open."""
    openai = pytest.importorskip("openai")
    s = Served(pipe, api_key="sekret-key")
    try:
        def client(key):
            return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0,
                                 timeout=60, http_client=httpx.Client(trust_env=False))
        done = client("sekret-key").completions.create(model="tiny", prompt="hello",
                                                       max_tokens=3, temperature=0)
        assert done.usage.completion_tokens == 3
        with pytest.raises(openai.AuthenticationError) as e:
            client("sekret-kez").models.list()
        assert e.value.body["code"] == "invalid_api_key"
        bare = httpx.post(s.url + "/v1/completions", timeout=10, trust_env=False,
                          json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(s.url + "/metrics", timeout=10, trust_env=False).status_code == 401
        assert httpx.get(s.url + "/health", timeout=10, trust_env=False).status_code == 200
    finally:
        s.stop()


def test_health_says_starting_while_the_engine_compiles(pipe, monkeypatch):
    """A server whose engine compiles in the background answers at once: /health 503
    "starting" and requests 503 until the compiling is done, then 200."""
    release = threading.Event()
    ready = []
    real = EngineCore.warmup

    def slow_warmup(core, *args, **kwargs):
        release.wait(60)
        return real(core, *args, **kwargs)

    monkeypatch.setattr(EngineCore, "warmup", slow_warmup)
    s = Served(pipe, warmup="background", on_ready=ready.append)
    try:
        health = httpx.get(s.url + "/health", timeout=10, trust_env=False)
        assert health.status_code == 503 and health.json() == {"status": "starting"}
        early = httpx.post(s.url + "/v1/completions", timeout=10, trust_env=False,
                           json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert early.status_code == 503 and early.json()["error"]["code"] == "starting"
        release.set()
        deadline = time.monotonic() + 120
        while httpx.get(s.url + "/health", timeout=10, trust_env=False).status_code != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.05)
        assert len(ready) == 1 and ready[0] > 0
        late = httpx.post(s.url + "/v1/completions", timeout=30, trust_env=False,
                          json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert late.status_code == 200
    finally:
        release.set()
        s.stop()


# ----- the command, as a process -------------------------------------------------------------
def start_server(target: Path, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dspine_cli", "serve", "--target", str(target), "--port",
         str(port), "--max-slots", "2", "--max-model-len", "64", "--grace-seconds", "5",
         *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise AssertionError(f"no healthy server at {url} after {timeout}s")


def test_serve_command_restarts_after_kill_and_exits_on_sigterm(tiny_llama_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    body = {"model": str(tiny_llama_dir), "prompt": "hello", "max_tokens": 5}
    cache = tmp_path / "compiled"
    first = start_server(tiny_llama_dir, port, "--compile-cache-dir", str(cache))
    try:
        wait_healthy(first, url)
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        assert any(cache.iterdir())          # the programs a restart loads instead
        first.kill()
        first.wait(30)
        second = start_server(tiny_llama_dir, port, "--compile-cache-dir", str(cache))
        try:
            wait_healthy(second, url)
            r = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            second.send_signal(signal.SIGTERM)
            # uvicorn re-raises the signal after its graceful shutdown: the status is that
            # of a process ended by SIGTERM (143 in a shell), reached only after the drain.
            assert second.wait(60) == -signal.SIGTERM
            assert "Application shutdown complete" in second.stdout.read()
            with pytest.raises(httpx.ConnectError):
                httpx.get(url + "/health", timeout=2, trust_env=False)
        finally:
            second.kill()
    finally:
        first.kill()


def test_sse_events_stay_one_line_whatever_the_text():
    """Sampled text can hold U+2028, U+2029 or U+0085, which JSON leaves raw but
    str.splitlines (httpx's aiter_lines) breaks lines at: each event must still read back
    as one `data:` line carrying the exact text."""
    from httpx._decoders import LineDecoder

    from dspine_serve.app import event

    text = "a\u2028b\u2029c\x85d\ne\r\"f\u00e9"
    lines = [line for line in LineDecoder().decode(event({"text": text}).decode()) if line]
    assert len(lines) == 1 and json.loads(lines[0].removeprefix("data: "))["text"] == text


def test_loop_histogram_exposes_what_prometheus_histogram_does():
    """The event loop's lock-free histogram (k equal observations in one call) must give
    the same /metrics text as prometheus_client's Histogram fed one observation at a time,
    values on bucket bounds, below the first and above the last included."""
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from dspine_serve.metrics import LATENCY_BUCKETS, LoopHistogram

    reference, ours = CollectorRegistry(), CollectorRegistry()
    want = Histogram("t_seconds", "doc", buckets=LATENCY_BUCKETS, registry=reference)
    got = LoopHistogram("t_seconds", "doc", LATENCY_BUCKETS, registry=ours)
    rng = random.Random(0)
    for _ in range(300):
        value = rng.choice([0.0, 0.001, 0.0025, 0.003, 0.2, 80.0, 1e3, rng.random()])
        k = rng.randint(1, 4)
        got.observe(value, count=k)
        for _ in range(k):
            want.observe(value)

    def lines(registry):
        return [line for line in generate_latest(registry).decode().splitlines()
                if "_created" not in line and "_sum " not in line]

    def total(registry):     # value x k against k additions: equal up to rounding
        return float(re.search(r"^t_seconds_sum (\S+)$", generate_latest(registry).decode(),
                               re.M).group(1))

    assert lines(ours) == lines(reference) and len(lines(ours)) == 2 + len(LATENCY_BUCKETS) + 2
    assert total(ours) == pytest.approx(total(reference), rel=1e-12)


def test_a_content_chunk_from_its_fixed_frame_equals_the_whole_event():
    """The streamed content chunk is built from the request's text around its piece: it
    must be byte for byte the event of the whole chunk, for chat and completions, quotes,
    escapes and line-break characters included, and for a model name holding the frame's
    own marker."""
    import types

    from dspine_serve.app import _Run, event

    pieces = ["hello", ' "quoted" \\ back', "a\u2028b\u2029c\x85d\ne", "\u00e9\u4e2d", "\0", ""]
    for chat, model in [(True, "m"), (False, "m"), (True, 'odd "name" \0')]:
        run = object.__new__(_Run)
        run.h = types.SimpleNamespace(model_name=model)
        run.chat, run.rid, run.created, run._frame = chat, "cmpl-1", 1700000000, None
        for piece in pieces:
            assert run._piece_event(piece) == event(run._chunk(piece, None)), (chat, piece)


def test_a_client_gone_before_its_body_is_a_quiet_client_error():
    """A client that disconnects while its body is read gets an APIError (a 4xx, no
    traceback in the log), not an unhandled ClientDisconnect."""
    from starlette.requests import Request

    from dspine_serve.app import _Handlers
    from dspine_serve.protocol import APIError, CompletionRequest

    async def receive():
        return {"type": "http.disconnect"}

    request = Request({"type": "http", "method": "POST", "path": "/v1/completions",
                       "headers": [], "query_string": b""}, receive)
    handlers = _Handlers.__new__(_Handlers)
    handlers.max_body_bytes = 1 << 20
    with pytest.raises(APIError) as caught:
        asyncio.run(handlers._parse(request, CompletionRequest))
    assert caught.value.status == 400 and caught.value.code == "client_disconnected"


def test_serve_startup_benchmark(tiny_llama_dir, tmp_path):
    """benchmarks/serve_startup.py: two starts on one compilation cache, each answering
    503 "starting" before its 200, and serving a completion; the restart reads every
    program from the program store."""

    from dspine_benchmarks import serve_startup

    out = tmp_path / "startup.json"
    report = serve_startup.main(["--target", str(tiny_llama_dir), "--max-slots", "1",
                                 "--port", str(free_port(2)), "--out", str(out), "--",
                                 "--max-model-len", "64"])
    assert report == json.loads(out.read_text())
    assert report["restarts"] == [report["restart"]]
    assert report["restart_median"]["ready_seconds"] == report["restart"]["ready_seconds"]
    for start in ("cold", "restart"):
        run = report[start]
        assert run["completion_status"] == 200 and run["log"][1].startswith("ready")
        assert run["first_answer"]["seconds"] <= run["ready_seconds"]
        # the unfiltered sampler's decode program compiles after the server is ready (a
        # restart reads it from the store, maybe before the ready line)
        if start == "cold":
            assert run["compiling_when_ready"] == 1 and "1 more programs" in run["log"][1]
            assert run["log"][2].startswith("compiled every program")
        assert run["ready_seconds"] <= run["all_compiled_seconds"]
        ready, stored = map(int, re.match(r"ready: (\d+) programs .*\((\d+) from the program "
                                          r"store", run["log"][1]).groups())
        assert ready > 0 and stored == (0 if start == "cold" else ready)
        # a line per program made ready before the server was
        assert len(run["programs"]) == ready, run["programs"]
        how = r": (traced [\d.]+s, compiled [\d.]+s|read from the program store)$"
        assert all(re.search(how, line) for line in run["programs"])
        assert sum("read from the program store" in line
                   for line in run["programs"]) == stored


def test_serving_compare_benchmark(tiny_llama_dir, tmp_path):
    """benchmarks/serving_compare.py: each server in turn, measured once its programs are
    all compiled, swept twice per level, every request served, its /health kept, and the
    summary's medians over the runs."""
    from dspine_benchmarks import serving_compare

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"the quick brown fox {i}", "chat": False})
                               + "\n" for i in range(4)))
    out = tmp_path / "cmp"
    serving_compare.main([
        "--server", "ar=--method ar", "--server", "ar-again=--method ar --max-slots 1",
        "--sweep", "1:2", "--sweep", "2:4", "--repeats", "2", "--max-tokens", "4",
        "--prompts", str(prompts), "--out", str(out), "--",
        "--target", str(tiny_llama_dir), "--max-model-len", "64", "--compile-cache-dir",
        "none"])
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["ar", "ar-again"]
    for name in summary:
        assert {c: s["runs"] for c, s in summary[name].items()} == {"1": 2, "2": 2}
        assert all(s["failed"] == 0 for s in summary[name].values())
        assert summary[name]["2"]["completed"] == 8
    assert json.loads((out / "ar-again" / "health.json").read_text())["max_slots"] == 1
    assert summary["ar"]["1"]["x_first"] == 1.0
    # measured once every program had compiled, not just once the server was ready
    start = json.loads((out / "ar" / "start.json").read_text())
    assert start["health"]["compiling"] == 0 and start["compiled_s"] >= start["ready_s"] > 0
    # each run's end: the server's /health and /metrics (the requests of the runs before
    # it counted: 2 + 4 + 2)
    run = out / "ar" / "run-2-1"
    assert json.loads((run / "health.json").read_text())["status"] == "ok"
    assert re.search(r"^dspine_time_to_first_token_seconds_count\S* 8\.0$",
                     (run / "metrics.txt").read_text(), re.M)


def test_serve_host_path_benchmark(tmp_path):
    """benchmarks/serve_host_path.py: the real app over a stand-in engine streams every
    request's max_tokens to the bench client, in pieces of --tokens-per-step."""
    from dspine_benchmarks import serve_host_path

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"hello {i}", "chat": i % 2 == 0})
                               + "\n" for i in range(4)))
    report = serve_host_path.main([
        "--concurrency", "2", "--max-slots", "2", "--num-prompts", "4", "--max-tokens", "10",
        "--tokens-per-step", "3", "--step-ms", "1", "--repeats", "1", "--prompts",
        str(prompts), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "h.json")])
    (run,) = report["runs"]
    assert run["completed"] == 4 and run["failed"] == 0 and run["total_output_tokens"] == 40
    assert report["device_ceiling_tokens_per_s"] == 2 * 3 / 1e-3
    assert json.loads((tmp_path / "h.json").read_text())["runs"] == report["runs"]


def test_simulated_device_serves_exact_budgets_with_the_profile_acceptance():
    """benchmarks/simulated_device.py: the real engine core over a device that only
    waits gives every request exactly its max_tokens, frees every page, verifies at the
    widths the policy picks, and accepts drafts at the given rate (alpha 0.6 over 15
    drafts: 1 + sum 0.6^i = 2.5 tokens a whole-block pass)."""
    from dspine_benchmarks.simulated_device import DeviceCosts, SimulatedDecoder
    from dspine_jax.runtime.engine_core import EngineConfig, EngineCore, SamplingOptions
    from dspine_jax.speculative.policy import SpeculationConfig, expected_tokens

    costs = DeviceCosts({1: 0.05, 8: 0.1}, {1: 0.1, 8: 0.2}, (0.01, 0.01))
    for alpha, speculation in ((None, "adaptive"), ([0.6], "fixed"), ([0.6], "adaptive")):
        decoder = SimulatedDecoder(costs, num_slots=8, vocabulary=[5, 6, 7], alpha=alpha,
                                   speculation=SpeculationConfig(speculation))
        core = EngineCore(decoder, EngineConfig(max_slots=8, max_model_len=512))
        core.warmup()
        budgets = {f"r{i}": 40 + 7 * i for i in range(12)}
        for rid, budget in budgets.items():
            core.add_request(rid, [9] * (3 + 5 * int(rid[1:])),
                             SamplingOptions(max_tokens=budget, ignore_eos=True))
        got = {rid: 0 for rid in budgets}
        lengths, widths = [], set()
        while core.has_work():
            for out in core.step():
                got[out.request_id] += len(out.new_token_ids)
                lengths += out.accept_lengths
                widths.add(out.verify_width)
                assert not out.finished or out.finish_reason == "length"
        assert got == budgets
        assert core.stats().free_pages == core.num_pages
        if alpha is None:
            assert set(lengths) == {1} and widths <= {0}
        elif speculation == "fixed":
            assert widths == {15} and max(lengths) <= 16
            assert sum(lengths) / len(lengths) == pytest.approx(
                expected_tokens([0.6] * 15, 15), rel=0.15)
        else:
            assert widths <= set(decoder.widths) and max(lengths) <= 16


def test_serve_simulated_benchmark(tmp_path):
    """benchmarks/serve_simulated.py: the AR and the drafter server over the simulated
    device stream every request's max_tokens to the bench client, side by side."""
    from dspine_benchmarks import serve_simulated

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"hello {i}", "chat": False}) + "\n"
                               for i in range(4)))
    report = serve_simulated.main([
        "--concurrency", "2", "--max-slots", "2", "--num-prompts", "4", "--max-tokens", "10",
        "--step-ms", "1:0.2", "--pass-ms", "1:0.4", "--prefill-ms", "0.1", "0.1",
        "--repeats", "1", "--prompts", str(prompts), "--work", str(tmp_path / "work"),
        "--out", str(tmp_path / "s.json")])
    assert set(report["runs"]) == {"ar@2", "dspine@2"}
    for (run,) in report["runs"].values():
        assert run["completed"] == 4 and run["failed"] == 0 and run["total_output_tokens"] == 40
    assert set(report["over_ar"]) == {"dspine"} and set(report["over_ar"]["dspine"]) == {2}
    assert json.loads((tmp_path / "s.json").read_text())["runs"] == report["runs"]
