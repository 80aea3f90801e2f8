"""The engine core: `add_request` / `abort` / `step` over a fixed set of slots.

In the shape of vLLM's EngineCore: the caller owns the loop (`while core.has_work():
outputs = core.step()`), and each `step` returns what each request gained since the last
one. One thread drives it; `dspine_serve.engine_loop` runs it in the server's background
thread. This module never imports the HTTP layer; device arrays never leave it.

The slots are the S rows of one batched decoder state, compiled once (no vmap): the
target's KV cache and the drafter's context are one `PagedKVCache` each, over one shared
pool of `num_pages` pages; each slot owns a row of the page table (`slots.SlotPages`).
Every step plans and queues the next calls, then reads the step queued before them:
the device runs one step while the host reads the last one, streams its tokens and plans
the next (as vLLM's and SGLang's overlap schedulers do). So a step is planned one step
behind what the device knows: a row that has just finished on the device runs one more
call (a no-op for it; its news are dropped), and pages are held for every queued call.
Every step:
  1. aborts take effect (the slot and its pages are free at once);
  2. each decoding request holds exactly the pages its queued calls and the next decode
     call can write (its cache length + each call's passes x the positions a pass can
     write, never past prompt + max_tokens + the verify block):
     it grows, and pages past that (left by rejected drafts near the end) go back; when
     the pool is short, the newest request in a slot is preempted: its pages are freed
     and it goes back to the head of the queue, to be recomputed later from its prompt
     and the tokens it already emitted (nothing is emitted twice);
  3. waiting requests are admitted, oldest first, while a slot is free and the pool
     holds the pages for the request's prompt plus one decode call;
  4. one prefill call writes the next chunk (`prefill_chunk` tokens) of every request
     still prefilling, so long prompts take several steps while the others keep
     decoding; a request whose prompt is complete starts: its first token is sampled
     (a preempted one takes its last emitted token back as the anchor);
  5. one decode call (`steps_per_call` target passes) runs over the decoding slots
     alone, gathered into a power-of-two number of rows (idle and prefilling slots are
     not computed; no call at all when none decodes); with a drafter under adaptive
     speculation each call verifies either the whole block or no draft at all (a plain
     AR step), as the decoder's `SpeculationPolicy` finds faster for the rows decoding,
     from the calls it timed and each request's acceptance; a call with a sampled row
     whose request gave a seed verifies the whole block, so that seed reproduces;
  6. the previous step's tokens are read back (one small transfer: each call returns
     what its rows gained in it); finished requests free their slots and pages.

Rows never mix: per-row sampling parameters, and one RNG key per row folded with the
row's token count, so a seeded request gives the same text alone, under load, and after
a preemption. Stop token ids and EOS end a request here (the EOS is kept in its tokens,
as the library does); stop strings need text and are applied by the server on
detokenized output (it then calls `abort`).

Shape legend: S slots, R rows in a decode call, G rows in a prefill call, T prefill chunk,
N output buffer (max_model_len).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import secrets
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspine_jax.decoding import BatchDecoder
from dspine_jax.errors import InputError
from dspine_jax.kv_cache import pages_needed
from dspine_jax.sampling import SAMPLING_MODES, batch_sampling_mode, validate_sampling
from dspine_jax.runtime import slot_steps
from dspine_jax.runtime.config import RuntimeConfig
from dspine_jax.runtime.slots import SlotPages

DEFAULT_PREFILL_CHUNK = 512

FINISH_REASONS = ("stop", "length", "abort")


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """One request's decoding options (OpenAI names). `seed=None` draws a fresh seed."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()           # applied on text by the server, not here
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        validate_sampling(self.temperature, self.top_p, self.top_k)
        if (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                or self.max_tokens < 1):
            raise InputError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and not (isinstance(self.seed, int)
                                          and 0 <= self.seed < 2 ** 63):
            raise InputError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")


@dataclasses.dataclass
class RequestOutput:
    """What one request gained in one step."""
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None        # stop (EOS or a stop token), length, abort
    accept_lengths: list[int]        # tokens emitted by each new target pass (1 for AR)
    prompt_tokens: int
    completion_tokens: int           # all tokens so far, EOS / stop token included
    verify_width: int = 0            # drafts each of those passes verified (0: AR step)


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
    speculation: str | None = None    # adaptive, fixed or off; None for AR
    verify_widths: tuple[int, ...] = ()   # the widths decode calls may verify
    runtime: dict = dataclasses.field(default_factory=dict)   # RuntimeConfig.to_json()
    # adaptive speculation's view: ms per pass by call rows and width (the median of the
    # latest calls), and the per-slot acceptance pooled over every request
    speculation_costs: dict = dataclasses.field(default_factory=dict)
    acceptance: tuple[float, ...] = ()

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
class _Request:
    request_id: str
    prompt: list[int]
    options: SamplingOptions
    seed: int
    tokens: list[int] = dataclasses.field(default_factory=list)  # emitted (all returned)
    slot: int = -1
    order: int = -1          # admission count: the newest is preempted first
    fill: list[int] = dataclasses.field(default_factory=list)    # tokens to prefill
    filled: int = 0          # of them in the cache
    decoding: bool = False   # prefill complete, the row runs in decode calls
    read: int = 0            # tokens emitted before this admission (a resumed request's)
    acceptance: object = None   # its AcceptanceStats under adaptive speculation
    queued: int = 0          # calls queued for it whose news are not read yet
    cache_bound: int = 0     # positions its cache can hold once its queued calls have run
    finished: bool = False   # ended or aborted: news still queued for it are dropped

    @property
    def max_positions(self) -> int:
        """Cache positions the request can ever need (set by check_request)."""
        return len(self.prompt) + self.options.max_tokens

    def cache_length(self) -> int:
        """Positions in the caches: the prefilled ones, or prompt + emitted minus the
        anchor (the last token, not yet written) once decoding."""
        return len(self.prompt) + len(self.tokens) - 1 if self.decoding else self.filled


@dataclasses.dataclass
class _Call:
    """A queued call: its rows' requests (None: padding, or a row whose prompt this
    prefill chunk does not complete), the news it returns, and its verify width."""
    requests: list
    news: concurrent.futures.Future    # of the call's news array
    decode: bool
    width: int | None = None
    passes: int = 0


@dataclasses.dataclass
class _Step:
    calls: list[_Call]
    queued_at: float        # when the host began queueing its calls
    compiles: int           # programs compiled before then (a timed step must see no more)
    timed: tuple | None     # (rows, width) of a step whose one call is a decode call


class EngineCore:
    """Continuous batching over `max_slots` slots sharing a pool of `num_pages` pages."""

    def __init__(self, decoder: BatchDecoder, *, max_slots: int = 8,
                 max_model_len: int | None = None, max_waiting: int | None = None,
                 num_pages: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 verify_widths: Sequence[int] | None = None):
        """num_pages: the shared pool's size; default max_slots x pages of max_model_len
        (every slot can hold a full-length request). prefill_chunk: prompt tokens a
        request prefills per step. verify_widths: the widths adaptive speculation chooses
        from (default: the two ends of its set, each a program per row bucket and
        sampling mode for `warmup` to compile; offline runs compile on first use and
        take the whole set)."""
        context = decoder.config.max_position_embeddings
        max_model_len = max_model_len or context
        if not isinstance(max_slots, int) or max_slots < 1:
            raise InputError(f"max_slots must be a positive integer, got {max_slots!r}")
        if not 0 < max_model_len <= context:
            raise InputError(f"max_model_len must be in [1, {context}] (the model's context), "
                             f"got {max_model_len}")
        if max_model_len <= decoder.extra_capacity + 1:
            raise InputError(f"max_model_len {max_model_len} leaves no room for a prompt and "
                             f"the {decoder.extra_capacity}-token verify block")
        per_slot = pages_needed(max_model_len, decoder.page_size)
        num_pages = max_slots * per_slot if num_pages is None else num_pages
        if not isinstance(num_pages, int) or num_pages < per_slot:
            raise InputError(f"num_pages must be at least {per_slot} (one request of "
                             f"max_model_len {max_model_len} in pages of {decoder.page_size}), "
                             f"got {num_pages!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise InputError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        self.decoder = decoder
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.prefill_chunk = prefill_chunk
        self.eos = tuple(int(t) for t in np.asarray(decoder.eos).tolist() if t >= 0)
        self.preemptions = 0
        self._steps = slot_steps.compiled(decoder)
        self._params = self._steps.params
        # what shapes the state: a key of every compiled call (cores share a decoder's)
        self._shapes = (max_slots, num_pages, max_model_len)
        self._row_sizes = slot_steps.row_buckets(max_slots)
        self._chunk_sizes = slot_steps.row_buckets(prefill_chunk, minimum=16)
        self._pages = SlotPages(max_slots, num_pages, decoder.page_size, max_model_len)
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: dict[int, _Request] = {}      # slot -> request
        self._by_id: dict[str, _Request] = {}
        self._aborted: list[_Request] = []           # aborted since the last step
        self._admissions = itertools.count()
        # Each slot's decode row (slot_steps.DECODE_FIELDS), and row S the padding row; a
        # decode call's rows are a gather of it.
        self._idle_rows = np.stack([slot_steps.pad_row(slot_steps.DECODE_FIELDS, max_slots,
                                                       slot=s) for s in range(max_slots + 1)])
        self._slot_rows = self._idle_rows.copy()
        self._table = (-1, None)     # (SlotPages.version, the page table on the device)
        self._queued: collections.deque[_Step] = collections.deque()  # steps not read yet
        # The device calls run in a thread of their own: on a GPU a call's multi-pass loop
        # holds the thread that launched it until its last pass is launched (the loop's
        # exit test is read on the host every pass), so the engine plans and reads in its
        # own thread meanwhile (the call releases the GIL). Only the runner thread touches
        # the device state once serving has begun.
        self._runner = concurrent.futures.ThreadPoolExecutor(1, "dspine-runner")
        self._next_passes = decoder.steps_per_call   # the next decode call's (set by _grow)
        # a decode call's pass count, by value: uploaded once, not per call
        self._passes_on_device = {n: jnp.int32(n) for n in
                                  {decoder.steps_per_call, decoder.shared_steps_per_call, 1}}
        self._last_read = 0.0        # when the last step's news arrived
        self._news_width = slot_steps.news_width(decoder)
        self._state = slot_steps.empty_state(decoder, self._pages.table, num_pages,
                                             out_len=max_model_len)
        # verify widths: the decoder's one width, or under adaptive speculation the two
        # ends of its set (each width is a program per row bucket and sampling mode)
        self._policy = decoder.speculation_policy()
        self._runtime = RuntimeConfig.of(decoder).to_json()
        default = decoder.default_width()
        if self._policy is None:
            self._widths = (default,)
        elif verify_widths is None:
            self._widths = (self._policy.widths[0], self._policy.widths[-1])
        else:
            unknown = sorted(set(verify_widths) - set(self._policy.widths))
            if unknown:
                raise InputError(f"verify widths {unknown} are not compiled by this "
                                 f"decoder (it has {list(self._policy.widths)})")
            self._widths = tuple(sorted(set(verify_widths)))
        # off during warm-up: its calls are each program's first run on the device (one-
        # time setup included) over a dummy prompt, neither a cost nor an acceptance
        self._learning = True

    @property
    def num_pages(self) -> int:
        return self._pages.num_pages

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling this core's decoder's programs so far (every core over
        the decoder shares them)."""
        return self._steps.compile_seconds

    def compiling_within(self, start: float, end: float) -> float:
        """Seconds of the perf_counter window [start, end] spent compiling."""
        return self._steps.compiling_within(start, end)

    def close(self) -> None:
        """Stop the runner thread once its queued calls are done (the core is unusable
        after)."""
        self._runner.shutdown(wait=True)

    # ----- the interface -------------------------------------------------------------------
    def check_request(self, prompt_token_ids: Sequence[int], options: SamplingOptions) -> None:
        """Raise InputError for a request this engine can never run (nothing is queued)."""
        options.validate()
        prompt = list(prompt_token_ids)
        if not prompt:
            raise InputError("the prompt is empty after tokenization")
        vocab = self.decoder.config.vocab_size
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise InputError(f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        bad = [t for t in options.stop_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise InputError(f"stop_token_ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        need = len(prompt) + options.max_tokens + self.decoder.extra_capacity
        context = self.decoder.config.max_position_embeddings
        if need > self.max_model_len:
            room = self.max_model_len - self.decoder.extra_capacity - len(prompt)
            raise InputError(
                f"the prompt has {len(prompt)} tokens and max_tokens is {options.max_tokens}"
                + (f" (plus a {self.decoder.extra_capacity}-token verify block)"
                   if self.decoder.extra_capacity else "")
                + f": {need} positions, past the engine's context of {self.max_model_len}"
                + (" (the model's)" if self.max_model_len == context else "") + ". "
                + (f"Lower max_tokens to at most {room}." if room > 0
                   else "Shorten the prompt."))

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    options: SamplingOptions) -> None:
        if request_id in self._by_id:
            raise InputError(f"request id {request_id!r} is already in the engine")
        self.check_request(prompt_token_ids, options)
        if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
            raise QueueFull(f"the queue is full ({self.max_waiting} requests waiting)")
        seed = options.seed if options.seed is not None else secrets.randbits(62)
        request = _Request(request_id, [int(t) for t in prompt_token_ids], options, seed)
        if self._policy is not None:
            request.acceptance = self._policy.new_row()
        self._waiting.append(request)
        self._by_id[request_id] = request

    def abort(self, request_id: str) -> bool:
        """Stop a request; its slot and pages are free for the next step. The next `step`
        returns its last output (finish_reason abort). False if unknown or already done."""
        request = self._by_id.get(request_id)
        if request is None:
            return False
        self._finish(request)
        self._aborted.append(request)
        return True

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot (preempted ones included)."""
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._aborted or self._queued)

    def stats(self) -> EngineStats:
        used = sum(r.cache_length() for r in self._running.values())
        pages = self._pages
        return EngineStats(max_slots=self.max_slots, running=len(self._running),
                           waiting=len(self._waiting),
                           capacity_tokens=pages.num_pages * self.decoder.page_size,
                           used_tokens=used, num_pages=pages.num_pages,
                           free_pages=pages.free_pages, preemptions=self.preemptions,
                           speculation=getattr(self.decoder, "speculation", None) and
                           self.decoder.speculation.mode,
                           verify_widths=tuple(w for w in self._widths if w is not None),
                           runtime=self._runtime, **self._policy_view())

    def _policy_view(self) -> dict:
        if self._policy is None:
            return {}
        costs: dict[str, dict[str, float]] = {}
        for (rows, width), seconds in sorted(self._policy.costs.seconds.items()):
            costs.setdefault(str(rows), {})[str(width)] = round(seconds * 1e3, 3)
        return {"speculation_costs": costs,
                "acceptance": tuple(round(a, 3) for a in self._policy.pool.alpha())}

    def step(self) -> list[RequestOutput]:
        """Queue this step's calls, then read the step queued before them (when nothing
        was queued now: the last one), so that the device is never idle while the host
        reads, streams and plans."""
        outputs = [self._output(r, [], [], "abort") for r in self._aborted]
        self._aborted = []
        self._grow()
        self._admit()
        queued = self._queue_step()
        if len(self._queued) > 1 or (self._queued and not queued):
            outputs += self._collect(self._queued.popleft())
        return outputs

    # ----- pages and slots -----------------------------------------------------------------
    def _decode_need(self, request: _Request) -> int:
        """Positions a request needs before the next decode call: what its queued calls
        can write and one call more."""
        held = request.cache_bound if request.decoding else len(request.fill)
        return min(held + self._next_passes * self.decoder.pass_positions,
                   request.max_positions + self.decoder.extra_capacity)

    def _grow(self) -> None:
        """Every decoding request holds the pages of its next decode call; the newest
        requests are preempted while the pool is short."""
        self._next_passes = self._passes(sum(r.decoding for r in self._running.values()))
        for request in sorted(self._running.values(), key=lambda r: r.order):
            if not request.decoding or request.slot < 0:
                continue
            need = self._decode_need(request)
            if self._pages.holds(request.slot, need):
                continue                 # most steps: no page boundary crossed
            while not self._pages.can_fit(request.slot, need):
                victim = max(self._running.values(), key=lambda r: r.order)
                self._preempt(victim)
                if victim is request:
                    break
            else:
                self._pages.resize(request.slot, need)

    def _preempt(self, request: _Request) -> None:
        """Free the request's slot and pages; it waits at the head of the queue and is
        recomputed from its prompt and the tokens it emitted (the last one becomes the
        anchor again), so nothing is emitted twice."""
        self._release(request)
        self._waiting.appendleft(request)
        self.preemptions += 1

    def _admit(self) -> None:
        while self._waiting and self._pages.free_slots:
            request = self._waiting[0]
            if request.queued:
                break            # preempted with news still queued: they come first
            # a preempted request recomputes its prompt and all but its last token
            request.fill = request.prompt + request.tokens[:-1]
            need = self._decode_need(request)
            if not self._pages.can_fit(None, need):
                break            # oldest first: the head waits for pages, no overtaking
            self._waiting.popleft()
            slot = self._pages.take(need)
            request.slot, request.order = slot, next(self._admissions)
            request.filled, request.decoding = 0, False
            request.read, request.cache_bound = len(request.tokens), 0
            o = request.options
            self._slot_rows[slot] = slot_steps.pad_row(
                slot_steps.DECODE_FIELDS, self.max_slots, slot=slot,
                temperature=o.temperature, top_p=o.top_p, top_k=o.top_k,
                ignore_eos=o.ignore_eos)
            self._running[slot] = request

    def _release(self, request: _Request) -> None:
        """Host side only: the slot's next request starts from an empty cache on its
        first prefill chunk, and no call computes an idle slot."""
        slot = request.slot
        del self._running[slot]
        self._pages.release(slot)
        self._slot_rows[slot] = self._idle_rows[slot]
        request.slot, request.decoding = -1, False

    def _finish(self, request: _Request) -> None:
        """The request is done (or aborted): its slot and pages are free, and news still
        queued for it will be dropped."""
        request.finished = True
        self._by_id.pop(request.request_id, None)
        if request.slot >= 0:
            self._release(request)
        elif request in self._waiting:
            self._waiting.remove(request)

    # ----- device calls --------------------------------------------------------------------
    def _page_table(self) -> jax.Array:
        """The page table on the device, uploaded again only when a row of it changed."""
        version, table = self._table
        if version != self._pages.version:   # a copy: the host table changes in place
            self._table = version, table = self._pages.version, jnp.array(self._pages.table)
        return table

    def _queue_step(self) -> bool:
        """Queue this step's calls: a prefill chunk for the requests still prefilling,
        then a decode call over the decoding slots (those that started in this prefill
        join the next step). False if there was nothing to run."""
        decoding = sorted(s for s, r in self._running.items() if r.decoding)
        queued_at, compiles = time.perf_counter(), self._steps.compiles
        calls = [c for c in (self._prefill(), self._decode(decoding) if decoding else None)
                 if c is not None]
        if not calls:
            return False
        timed = None
        if self._learning and self._policy is not None and len(calls) == 1 \
                and calls[0].decode:
            timed = (len(calls[0].requests), calls[0].width)
        self._queued.append(_Step(calls, queued_at, compiles, timed))
        return True

    def _prefill(self) -> _Call | None:
        """One chunk for every request still prefilling; those whose prompt is complete
        start decoding."""
        rows = [r for r in self._running.values() if r.filled < len(r.fill)]
        if not rows:
            return None
        g = slot_steps.bucket_up(len(rows), self._row_sizes)
        longest = max(len(r.fill) - r.filled for r in rows)
        t = slot_steps.bucket_up(min(longest, self.prefill_chunk), self._chunk_sizes)
        matrix = self._prefill_matrix(g, t)
        f = len(slot_steps.PREFILL_FIELDS)
        starting: list[_Request | None] = [None] * g
        for i, r in enumerate(rows):
            fields, chunk = self._prefill_row(r, t)
            matrix[i, :f], matrix[i, f:f + len(chunk)] = fields, chunk
            if r.decoding:
                starting[i] = r
                r.queued += 1
        news = self._call("prefill", (self._shapes, g, t), matrix, mode="filtered")
        return _Call(starting, news, decode=False)

    def _prefill_matrix(self, g: int, t: int) -> np.ndarray:
        """[g, F + t] int32: g padding rows (aimed at slot S) of a chunk of t."""
        pad = slot_steps.pad_row(slot_steps.PREFILL_FIELDS, self.max_slots)
        return np.concatenate([np.tile(pad, (g, 1)), np.zeros((g, t), np.int32)], axis=1)

    def _prefill_row(self, r: _Request, t: int) -> tuple[np.ndarray, list[int]]:
        """Request r's fields and tokens in a prefill call of chunk t; a request whose
        prompt this chunk completes starts decoding."""
        chunk = r.fill[r.filled:r.filled + t]
        values = dict(slot=r.slot, q_len=len(chunk), first_chunk=r.filled == 0)
        r.filled += len(chunk)
        r.cache_bound = r.filled
        if r.filled == len(r.fill):
            o = r.options
            values.update(start_slot=r.slot, budget=o.max_tokens, seed=r.seed % 2 ** 32,
                          temperature=o.temperature, top_p=o.top_p, top_k=o.top_k,
                          ignore_eos=o.ignore_eos, read=r.read)
            if r.tokens:
                values.update(resume_token=r.tokens[-1], resume_count=len(r.tokens))
            r.decoding = True
        return slot_steps.pad_row(slot_steps.PREFILL_FIELDS, self.max_slots, **values), chunk

    def _decode(self, decoding: list[int]) -> _Call:
        """One decode call over the decoding slots only, padded to a bucket of rows."""
        rows = slot_steps.bucket_up(len(decoding), self._row_sizes)
        slots = np.full((rows,), self.max_slots, np.int32)     # padding rows aim at slot S
        slots[:len(decoding)] = decoding
        matrix = self._slot_rows[slots]
        requests = [self._running[s] for s in decoding]
        mode = self._sampling_mode(matrix)
        width = self._width(rows, requests)
        passes = self._next_passes          # what _grow held pages for
        news = self._call("decode", (self._shapes, rows, mode, width), matrix,
                          self._passes_on_device[passes], mode=mode, width=width)
        for r in requests:
            r.queued += 1
            r.cache_bound += passes * self.decoder.pass_positions
        return _Call(requests + [None] * (rows - len(requests)), news, decode=True,
                     width=width, passes=passes)

    def _passes(self, decoding: int) -> int:
        """Passes of the next decode call: the decoder's most for a row decoding alone
        with nobody waiting (a long call then delays no one, and pays the per-call cost
        less often), else its shared count (a finishing row's slot and a waiting request
        wait for the call's end)."""
        if decoding == 1 and not self._waiting:
            return self.decoder.steps_per_call
        return self.decoder.shared_steps_per_call

    def _width(self, rows: int, requests: list[_Request]) -> int | None:
        """The verify width of the next decode call over these requests."""
        if self._policy is None:
            return self._widths[0]
        if any(r.options.seed is not None and r.options.temperature > 0 for r in requests):
            return self._widths[-1]          # a seeded sample reproduces at one width only
        return self._policy.choose(rows, [r.acceptance for r in requests],
                                   widths=self._widths)

    def _sampling_mode(self, matrix: np.ndarray) -> str:
        """What a decode call's rows ask of the sampler (part of its key): all greedy (no
        sampling is traced), sampled without top-k/top-p (no vocabulary threshold), or
        filtered."""
        column = lambda name: matrix[:, slot_steps.DECODE_FIELDS.index(name)]  # noqa: E731
        with self.decoder.switches.active():
            return batch_sampling_mode(column("temperature").view(np.float32),
                                       column("top_p").view(np.float32), column("top_k"))

    def _call(self, name: str, key, matrix: np.ndarray, *inputs, mode: str,
              **static) -> concurrent.futures.Future:
        """Queue a call for the runner thread; returns the future of its news (read later,
        by `_collect`). inputs: decode's passes."""
        return self._runner.submit(self._run, name, key, self._page_table(),
                                   jnp.asarray(matrix), inputs, mode, static)

    def _run(self, name: str, key, page_table, matrix, inputs: tuple, mode: str,
             static: dict) -> jax.Array:
        """In the runner thread: one call on the device state."""
        self._state, news = self._steps(name, key, self._params, self._state, page_table,
                                        matrix, *inputs, mode=mode, **static)
        return news

    def _gained(self, news: list[int]) -> tuple[list[int], list[int], bool]:
        """(tokens, pass lengths, done) a row gained in one call, from its news."""
        width, most = self._news_width
        num, passes, done = news[:3]
        if not (0 <= num <= width and 0 <= passes <= most):
            raise AssertionError(f"a row gained {num} tokens and {passes} passes in one "
                                 f"call; its news hold {width} and {most}")
        return news[3:3 + num], news[3 + width:3 + width + passes], bool(done)

    def _collect(self, step: _Step) -> list[RequestOutput]:
        """Read a queued step's news (one device-to-host transfer) and hand each request
        what it gained; finished requests free their slots and pages."""
        arrays = jax.device_get([call.news.result() for call in step.calls])
        read_at = time.perf_counter()
        previous, self._last_read = self._last_read, read_at
        outputs = []
        passes = 0
        for call, news in zip(step.calls, arrays):
            for r, row in zip(call.requests, news.tolist()):   # lists: cheap row slices
                if r is None:
                    continue
                r.queued -= 1
                new, accepted, done = self._gained(row)
                passes = max(passes, len(accepted))
                if call.decode:     # its positions are known now: the bound tightens
                    r.cache_bound -= call.passes * self.decoder.pass_positions - len(new)
                if r.finished:
                    continue        # ended or aborted since this call was queued
                reason = None
                stops = r.options.stop_token_ids
                cut = next((i for i, t in enumerate(new) if t in stops), None) if stops \
                    else None
                if cut is not None:
                    new, reason = new[:cut + 1], "stop"
                elif done:
                    last = (r.tokens + new)[-1:]
                    hit_eos = last and last[0] in self.eos and not r.options.ignore_eos
                    reason = "stop" if hit_eos else "length"
                r.tokens += new
                self._observe_acceptance(r, accepted, call.width,
                                         done or reason is not None)
                outputs.append(self._output(r, new, accepted, reason, call.width))
                if reason is not None:
                    self._finish(r)
        if step.timed is not None and step.compiles == self._steps.compiles:
            # the device ran this step from when it was queued or the last step ended
            rows, width = step.timed
            self._policy.observe_call(rows, width, read_at - max(step.queued_at, previous),
                                      passes)
        return outputs

    def _observe_acceptance(self, r: _Request, accepted: list[int], width: int | None,
                            finished: bool) -> None:
        """Each pass's accepted drafts into the request's and the pool's statistics (a
        finished request's last pass may be cut by EOS or its budget: not counted)."""
        if self._policy is None or not accepted or not self._learning:
            return
        for length in accepted[:-1] if finished else accepted:
            self._policy.observe_pass(r.acceptance, width, min(length - 1, width))

    @staticmethod
    def _output(r: _Request, new: list[int], accepted: list[int],
                reason: str | None, width: int | None = None) -> RequestOutput:
        return RequestOutput(request_id=r.request_id, new_token_ids=new,
                             finished=reason is not None, finish_reason=reason,
                             accept_lengths=accepted, prompt_tokens=len(r.prompt),
                             completion_tokens=len(r.tokens), verify_width=width or 0)

    def warmup(self, modes: Sequence[str] = SAMPLING_MODES) -> float:
        """Compile before serving: every decode call (each row bucket x sampling mode in
        `modes`; a caller that knows its requests never filter, or never sample, leaves
        those modes out) and every prefill call (each row bucket x chunk bucket), in
        parallel; then one request end to end. Returns seconds."""
        unknown = sorted(set(modes) - set(SAMPLING_MODES))
        if unknown:
            raise InputError(f"unknown sampling modes {unknown}; choose from {SAMPLING_MODES}")
        t0 = time.perf_counter()
        calls = []
        for r, mode, width in itertools.product(self._row_sizes, modes, self._widths):
            matrix = self._idle_rows[np.full((r,), self.max_slots)]
            calls.append(("decode", (self._shapes, r, mode, width),
                          self._args(matrix) + (self._passes_on_device[1],), mode,
                          {"width": width}))
        for g, t in itertools.product(self._row_sizes, self._chunk_sizes):
            calls.append(("prefill", (self._shapes, g, t),
                          self._args(self._prefill_matrix(g, t)), "filtered", {}))
        self._steps.precompile(calls)
        n = max(1, min(8, self.max_model_len - self.decoder.extra_capacity - 2))
        self.add_request("__warmup", [0] * n, SamplingOptions(
            max_tokens=2, temperature=0.0, seed=0, ignore_eos=True))
        self._learning = False
        try:
            while self.has_work():
                self.step()
        finally:
            self._learning = True
        return time.perf_counter() - t0

    def _args(self, matrix: np.ndarray) -> tuple:
        return self._params, self._state, self._page_table(), jnp.asarray(matrix)


class QueueFull(InputError):
    """The waiting queue is at its bound: the server answers 429."""
