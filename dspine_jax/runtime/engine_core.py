"""The engine core: `add_request` / `abort` / `step` over a fixed set of slots.

In the shape of vLLM's EngineCore: the caller owns the loop (`while core.has_work():
outputs = core.step()`), and each `step` returns what each request gained since the last
one. One thread drives it; `dspine_serve.engine_loop` runs it in the server's background
thread, `offline.stream_tokens` in the caller's. This module never imports the HTTP layer;
device arrays never leave it.

Two halves: the `Scheduler` (host only, no JAX: requests, admission, page accounting,
chunked prefill, preemption; it plans each step's calls) and the `Runner` (the device
state of the S slots, the compiled calls and the thread that runs them). Every step plans
and queues the next calls, then reads the step queued before them: the device runs one
step while the host reads the last one, streams its tokens and plans the next (as
vLLM's and SGLang's overlap schedulers do). Reading a step is one small transfer: each
call returns what its rows gained in it.

Rows never mix: per-row sampling parameters, and one RNG key per row folded with the
row's token count, so a seeded request gives the same text alone, under load, and after
a preemption. Stop token ids and EOS end a request here (the EOS is kept in its tokens,
as the library does); stop strings need text and are applied by the server on
detokenized output (it then calls `abort`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import time
from typing import Sequence

import jax
import numpy as np

from dspine_jax.decoding import BatchDecoder
from dspine_jax.errors import InputError
from dspine_jax.runtime import slot_steps
from dspine_jax.runtime.config import DEFAULT_PREFILL_CHUNK, EngineConfig, RuntimeConfig
from dspine_jax.runtime.requests import (FINISH_REASONS, QueueFull, RequestOutput,
                                         SamplingOptions, merge_outputs)
from dspine_jax.runtime.runner import Runner
from dspine_jax.runtime.scheduler import Call, DecoderSpec, Scheduler
from dspine_jax.sampling import SAMPLING_MODES

__all__ = ["DEFAULT_PREFILL_CHUNK", "EngineConfig", "EngineCore", "EngineStats", "FINISH_REASONS",
           "QueueFull", "RequestOutput", "SamplingOptions"]


@dataclasses.dataclass
class EngineStats:
    max_slots: int
    running: int            # requests in a slot (prefilling or decoding)
    waiting: int
    capacity_tokens: int    # KV positions in the page pool (num_pages x page size)
    used_tokens: int        # prompt + generated positions held by running requests
    num_pages: int
    free_pages: int
    preemptions: int        # requests preempted since the start (recomputed later)
    compiling: int = 0      # programs still compiling in the background
    speculation: str | None = None    # adaptive, fixed or off; None for AR
    verify_widths: tuple[int, ...] = ()   # the widths decode calls may verify
    runtime: dict = dataclasses.field(default_factory=dict)   # RuntimeConfig.to_json()
    engine: dict = dataclasses.field(default_factory=dict)    # EngineConfig.to_json()
    # adaptive speculation's view: ms per pass by call rows and width (the median of the
    # latest calls), and the per-slot acceptance pooled over every request
    speculation_costs: dict = dataclasses.field(default_factory=dict)
    acceptance: tuple[float, ...] = ()
    # seconds since the start: the device running prefill and decode calls, and idle
    # between a call's end and the next launch (the host's share of a busy server)
    device_seconds: dict = dataclasses.field(default_factory=dict)

    @property
    def free_slots(self) -> int:
        return self.max_slots - self.running

    @property
    def cache_usage(self) -> float:
        """Pages held / pages in the pool."""
        return 1 - self.free_pages / self.num_pages if self.num_pages else 0.0

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "free_slots": self.free_slots,
                "cache_usage": round(self.cache_usage, 4)}


@dataclasses.dataclass
class _Step:
    calls: list[Call]
    compiles: int           # programs compiled before it was queued (a timed step must
                            # see no more)
    timed: Call | None      # its decode call, timed for adaptive speculation


class EngineCore:
    """Continuous batching over `max_slots` slots sharing a pool of `num_pages` pages."""

    def __init__(self, decoder: BatchDecoder, config: EngineConfig = EngineConfig()):
        """config: slots, request length, page pool, prefill chunk, queue, and the widths
        adaptive speculation chooses from (default: its whole set; the widest is ready
        before serving and the others compile in the background, `warmup`: a narrower
        verify pays where passes are dear, many rows on a GPU, and needs its own
        programs). `self.config` is the resolved copy."""
        policy = decoder.speculation_policy()
        if policy is None:
            widths = (decoder.default_width(),)
        elif config.verify_widths is None:
            widths = policy.widths
        else:
            unknown = sorted(set(config.verify_widths) - set(policy.widths))
            if unknown:
                raise InputError(f"verify widths {unknown} are not compiled by this "
                                 f"decoder (it has {list(policy.widths)})")
            widths = config.verify_widths
        spec = DecoderSpec.of(decoder, slot_steps.news_width(decoder))
        self.scheduler = Scheduler(spec, config, policy=policy, widths=widths)
        self.config = dataclasses.replace(
            self.scheduler.config,
            verify_widths=tuple(w for w in widths if w is not None) or None)
        self.decoder = decoder
        s = self.scheduler
        self._runner = Runner(decoder, s.pages, self.max_model_len, row_sizes=s.row_sizes,
                              chunk_sizes=s.chunk_sizes, widest=s.widths[-1])
        self._policy = policy
        self._queued: collections.deque[_Step] = collections.deque()  # steps not read yet
        # timed decode calls whose device time is not observed yet: (rows, width, passes,
        # the future of the seconds)
        self._timings: collections.deque[tuple] = collections.deque()
        self._runtime = RuntimeConfig.of(decoder).to_json()
        # after `warmup`: the Future of the background compiles' seconds
        self.background_compile: concurrent.futures.Future | None = None

    @property
    def max_slots(self) -> int:
        return self.config.max_slots

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def prefill_chunk(self) -> int:
        return self.config.prefill_chunk

    @property
    def num_pages(self) -> int:
        return self.scheduler.pages.num_pages

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling this core's decoder's programs so far (every core over
        the decoder shares them)."""
        return self._runner.steps.compile_seconds

    @property
    def compiling(self) -> int:
        """Programs still compiling in the background (after `warmup`)."""
        return self._runner.steps.compiling

    @property
    def programs(self) -> tuple[int, int]:
        """(programs ready, of which read from the program store rather than compiled)."""
        steps = self._runner.steps
        return steps.compiles, steps.loaded

    def on_program_ready(self, callback) -> None:
        """Call `callback(slot_steps.ProgramTiming)` as each program becomes ready (in the
        thread that compiled or loaded it); None stops it."""
        self._runner.steps.on_ready = callback

    @property
    def program_timings(self) -> list:
        """The `slot_steps.ProgramTiming` of every program made ready so far."""
        return list(self._runner.steps.timings)

    def compiling_within(self, start: float, end: float) -> float:
        """Seconds of the perf_counter window [start, end] spent compiling."""
        return self._runner.steps.compiling_within(start, end)

    def close(self) -> None:
        """Stop the runner thread once its queued calls are done (the core is unusable
        after)."""
        self._runner.close()

    # ----- the interface -------------------------------------------------------------------
    def check_request(self, prompt_token_ids: Sequence[int], options: SamplingOptions) -> None:
        """Raise InputError for a request this engine can never run (nothing is queued)."""
        self.scheduler.check_request(prompt_token_ids, options)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    options: SamplingOptions) -> None:
        self.scheduler.add_request(request_id, prompt_token_ids, options)

    def abort(self, request_id: str) -> bool:
        """Stop a request; its slot and pages are free for the next step. The next `step`
        returns its last output (finish_reason abort). False if unknown or already done."""
        return self.scheduler.abort(request_id)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot (preempted ones included)."""
        return self.scheduler.num_waiting

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._queued)

    def stats(self) -> EngineStats:
        pages = self.scheduler.pages
        return EngineStats(max_slots=self.max_slots, running=self.scheduler.num_running,
                           waiting=self.scheduler.num_waiting,
                           capacity_tokens=pages.num_pages * self.decoder.page_size,
                           used_tokens=self.scheduler.used_tokens(), num_pages=pages.num_pages,
                           free_pages=pages.free_pages, preemptions=self.preemptions,
                           speculation=getattr(self.decoder, "speculation", None) and
                           self.decoder.speculation.mode,
                           verify_widths=tuple(w for w in self.scheduler.widths
                                               if w is not None),
                           runtime=self._runtime, engine=self.config.to_json(),
                           compiling=self.compiling,
                           device_seconds={k: round(v, 4) for k, v in
                                           self._runner.device_seconds.items()},
                           **self._policy_view())

    def _policy_view(self) -> dict:
        if self._policy is None:
            return {}
        costs: dict[str, dict[str, float]] = {}
        for (rows, width), seconds in sorted(self._policy.costs.seconds.items()):
            costs.setdefault(str(rows), {})[str(width)] = round(seconds * 1e3, 3)
        return {"speculation_costs": costs,
                "acceptance": tuple(round(a, 3) for a in self._policy.pool.alpha())}

    def step(self, on_first_tokens=None) -> list[RequestOutput]:
        """Queue this step's calls, then read the step queued before them (when nothing
        was queued now: the last one), so that the device is never idle while the host
        reads, streams and plans. A request whose prompt a step's prefill completes also
        decodes in that step's decode call: its first token and that call's tokens come
        back as one output, or, with `on_first_tokens`, the prefill's outputs go to
        `on_first_tokens(outputs)` as soon as they are read, before the decode call behind
        them ends (a server streams first tokens sooner), and the rest are returned."""
        outputs, queued = self._queue_step()
        if len(self._queued) > 1 or (self._queued and not queued):
            outputs += self._collect(self._queued.popleft(), on_first_tokens)
        return outputs

    # ----- one step --------------------------------------------------------------------
    def _queue_step(self) -> tuple[list[RequestOutput], bool]:
        """Plan this step and queue its calls on the runner: -> the aborted requests'
        outputs, and whether any call was queued."""
        compiles = self._runner.steps.compiles
        outputs, calls = self.scheduler.schedule()
        if not calls:
            return outputs, False
        for call in calls:
            call.pipelined = bool(self._queued)
            call.news = self._runner.submit(call)
        timed = None
        # the decode call's device time (each call's is measured alone); a call timed
        # while programs compile beside it would teach the policy their cost, and a
        # program's first run its one-time setup (a width first run in the background
        # measured 3x its cost, and the policy never tried it again)
        decode = calls[-1]
        if self.scheduler.learning and self._policy is not None and decode.decode \
                and not self.compiling and not decode.first_run:
            timed = decode
        elif self._policy is not None and decode.decode:
            self._policy.not_timed()
        self._queued.append(_Step(calls, compiles, timed))
        return outputs, True

    def _collect(self, step: _Step, on_first_tokens=None) -> list[RequestOutput]:
        """Read a queued step's news (one device-to-host transfer, or two with
        `on_first_tokens`: `step`) and hand them to the scheduler; time the step's decode
        call for adaptive speculation."""
        calls = step.calls
        if on_first_tokens is not None and len(calls) > 1:
            [news] = self._runner.read([calls[0].news])
            on_first_tokens(self.scheduler.receive(calls[0], news)[0])
            calls = calls[1:]
        arrays = self._runner.read([call.news for call in calls])
        outputs, passes = [], 0
        for call, news in zip(calls, arrays):
            gained, ran = self.scheduler.receive(call, news)
            outputs += gained
            passes = max(passes, ran)
        if len(calls) > 1:         # a prefill's first tokens and its decode call's
            outputs = merge_outputs(outputs)
        timed = step.timed
        if timed is not None and step.compiles == self._runner.steps.compiles:
            self._timings.append((len(timed.requests), timed.width, passes, timed.passes,
                                  timed.device_seconds))
        elif timed is not None:             # a program compiled meanwhile: not a sample
            self._policy.not_timed()
        # the device times the timer thread has measured by now (none is waited for)
        while self._timings and self._timings[0][-1].done():
            rows, width, passes, most, seconds = self._timings.popleft()
            self._policy.observe_call(rows, width, seconds.result(), passes, most)
        return outputs

    def compile_ahead(self, decode_rows: Sequence[int], modes: Sequence[str],
                      prefills) -> None:
        """Compile, in parallel, the decode call of each row bucket in `decode_rows` x
        sampling mode x verify width, and the prefill call of each (rows, chunk) in
        `prefills` (buckets both), without running them."""
        calls = [self._decode_call(rows, mode, width) for rows, mode, width
                 in itertools.product(decode_rows, modes, self.scheduler.widths)]
        self._runner.precompile(calls + [self._prefill_call(g, t) for g, t in prefills])

    def _decode_call(self, rows: int, mode: str, width: int | None) -> Call:
        return Call("decode", self.scheduler.idle_rows[np.full((rows,), self.max_slots)],
                    [None] * rows, width=width, passes=1, mode=mode)

    def _prefill_call(self, rows: int, chunk: int) -> Call:
        return Call("prefill", self.scheduler.prefill_matrix(rows, chunk), [None] * rows)

    def warmup(self, modes: Sequence[str] = SAMPLING_MODES) -> float:
        """Compile before serving, in parallel, the few programs that can run any request
        (`modes`: the sampling modes requests will take; a caller that knows its requests
        never filter, or never sample, leaves those modes out): decode at the widest verify
        width over one row, greedy, and over the most rows, greedy and the most general of
        `modes` (on a CPU also one row in that mode); prefill of the longest chunk over one
        row (on a CPU: of every chunk) and over the most rows; then one request end to
        end. Returns seconds. Every other program then compiles in background threads
        (`compiling` counts them), and until one is ready its calls run on a larger or
        more general one (`Runner.cover`) with the same tokens: on an accelerator the
        server is ready after at most five programs, whatever its slots and chunks."""
        unknown = sorted(set(modes) - set(SAMPLING_MODES))
        if unknown:
            raise InputError(f"unknown sampling modes {unknown}; choose from {SAMPLING_MODES}")
        t0 = time.perf_counter()
        s = self.scheduler
        modes = [m for m in SAMPLING_MODES if m in modes]
        greedy, general = modes[0], modes[-1]
        one, most, widest, longest = s.row_sizes[0], s.row_sizes[-1], s.widths[-1], \
            s.chunk_sizes[-1]
        # on a CPU a call costs in proportion to its rows and tokens (one row's 2-token
        # prompt on the 512-token program, or its sampled decode on the 8-row one: ~10 s
        # of SmolLM2 + DSpine on 2 cores), so one row's programs are ready in the general
        # mode and at every chunk there; on an accelerator a small call costs about what
        # a large one does, and the largest cover them
        cpu = jax.default_backend() == "cpu"
        first_decode = list(dict.fromkeys(
            [(one, greedy, widest)] + [(one, general, widest)] * cpu
            + [(most, greedy, widest), (most, general, widest)]))
        one_row = s.chunk_sizes if cpu else [longest]
        first_prefill = list(dict.fromkeys([(one, t) for t in one_row] + [(most, longest)]))
        # later, most used first: the widest width at every row bucket (greedy, then the
        # general mode), the narrower widths (greedy first), one row's shorter chunks,
        # several rows' shorter chunks, then the other modes
        decode_later = [(r, m, widest) for m in (greedy, general) for r in s.row_sizes]
        decode_later += [(r, m, w) for m in modes for r in s.row_sizes for w in s.widths[:-1]]
        decode_later += [(r, m, widest) for m in modes for r in s.row_sizes]
        prefill_later = [(g, t) for g in s.row_sizes for t in reversed(s.chunk_sizes)]
        first = [self._decode_call(*c) for c in first_decode]
        first += [self._prefill_call(*c) for c in first_prefill]
        later = [self._decode_call(*c) for c in dict.fromkeys(decode_later)
                 if c not in first_decode]
        later += [self._prefill_call(*c) for c in dict.fromkeys(prefill_later)
                  if c not in first_prefill]
        self._runner.precompile(first)
        # one request end to end on those programs (each call's first run pays the
        # device's one-time setup of it), then the rest compile in the background
        n = max(1, min(8, self.max_model_len - self.decoder.extra_capacity - 2))
        self.add_request("__warmup", [0] * n, SamplingOptions(
            max_tokens=2, temperature=0.0, seed=0, ignore_eos=True))
        s.learning, self._runner.covering = False, True
        try:
            while self.has_work():
                self.step()
        finally:
            s.learning, self._runner.covering = True, False
        self.background_compile = self._runner.precompile(later, background=True)
        return time.perf_counter() - t0
