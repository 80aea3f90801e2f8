"""The engine's host side: requests, admission, page accounting, chunked prefill,
preemption, and the calls of each step. Imports no JAX (`tests/test_scheduler.py` runs it
without a device): `EngineCore` hands each planned `Call` to the device runner and each
call's news back here.

Every step (`schedule`):
  1. aborts take effect (the slot and its pages are free at once);
  2. each decoding request holds exactly the pages its queued calls and the next decode
     call can write (its cache length + each call's passes x the positions a pass can
     write, never past prompt + max_tokens + the verify block): it grows, and pages past
     that (left by rejected drafts near the end) go back; when the pool is short, the
     newest request in a slot is preempted: its pages are freed and it goes back to the
     head of the queue, to be recomputed later from its prompt and the tokens it already
     emitted (nothing is emitted twice);
  3. waiting requests are admitted, oldest first, while a slot is free and the pool
     holds the pages for the request's prompt plus one decode call;
  4. one prefill call writes the next chunk (`prefill_chunk` tokens) of every request
     still prefilling, so long prompts take several steps while the others keep
     decoding; a request whose prompt is complete starts decoding;
  5. one decode call runs over the decoding slots alone, gathered into a bucket of rows:
     the decoder's most passes (`steps_per_call`) while one row decodes alone and nobody
     waits, else its shared count, and fewer while adaptive speculation times an end of
     its widths (`MEASURING_PASSES`); with adaptive speculation the policy picks the verify
     width from the calls it timed and each request's acceptance (a sampled request with
     a seed verifies the whole block, so that seed reproduces).
`receive(call, news)` then hands each request what the call gained: tokens, pass
lengths, whether it finished (EOS, a stop token id, its budget).

The plan is made one step behind what the device knows (the engine queues step N+1
before it reads step N): a row that has just finished on the device runs one more call
(a no-op for it; its news are dropped), and pages are held for every queued call.

Shape legend: S slots, R rows in a decode call, G rows in a prefill call, T prefill chunk,
F fields of a row (`rows`), W tokens and P passes a call can emit per row.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import secrets
from typing import Sequence

import numpy as np

from dspine_jax.errors import InputError
from dspine_jax.page_pool import pages_needed
from dspine_jax.runtime import rows as row_fields
from dspine_jax.runtime.config import DEFAULT_PREFILL_CHUNK, EngineConfig
from dspine_jax.runtime.requests import QueueFull, RequestOutput, SamplingOptions
from dspine_jax.runtime.slots import SlotPages

__all__ = ["Call", "DEFAULT_PREFILL_CHUNK", "DecoderSpec", "EngineConfig", "Request",
           "Scheduler"]

# Passes of a decode call that adaptive speculation runs to time an end of its widths
# (as many as `dspine serve` runs while rows share a call).
MEASURING_PASSES = 4


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """What the scheduler needs to know of a decoder, as plain numbers."""
    vocab_size: int
    context: int                  # the model's max_position_embeddings
    page_size: int
    extra_capacity: int           # cache positions a pass writes past the last token
    pass_positions: int           # positions one pass can write (and advance a row by)
    steps_per_call: int           # passes of a decode call, at most
    shared_steps_per_call: int    # passes while several rows decode or requests wait
    eos: tuple[int, ...]
    news_width: tuple[int, int]   # (W, P): tokens and passes a row can gain in one call

    @classmethod
    def of(cls, decoder, news_width: tuple[int, int]) -> "DecoderSpec":
        return cls(vocab_size=decoder.config.vocab_size,
                   context=decoder.config.max_position_embeddings,
                   page_size=decoder.page_size, extra_capacity=decoder.extra_capacity,
                   pass_positions=decoder.pass_positions,
                   steps_per_call=decoder.steps_per_call,
                   shared_steps_per_call=decoder.shared_steps_per_call,
                   eos=tuple(int(t) for t in np.asarray(decoder.eos).tolist() if t >= 0),
                   news_width=news_width)


@dataclasses.dataclass
class Request:
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
class Call:
    """One planned device call: `rows` its int32 row matrix (`rows.DECODE_FIELDS`, or
    `rows.PREFILL_FIELDS` then the chunk's tokens), `requests` the request whose news
    each row returns (None: padding, or a row whose prompt this chunk does not
    complete). The runner attaches the future of its news (`news`) once queued, and the
    future of the seconds the device spent on it (`device_seconds`) once launched."""
    kind: str                       # "prefill" or "decode"
    rows: np.ndarray                # [G, F + T] or [R, F]
    requests: list
    width: int | None = None        # decode: the verify width
    passes: int = 0                 # decode: target passes
    mode: str | None = None         # decode: the sampling mode (None: the rows')
    news: object = None
    device_seconds: object = None
    # queued behind a call still in flight: the device's wait before it is the host's
    pipelined: bool = False
    # its program's first run in this process (one-time device setup: not a cost sample)
    first_run: bool = False

    @property
    def decode(self) -> bool:
        return self.kind == "decode"


class Scheduler:
    """Continuous batching over `max_slots` slots sharing a pool of `num_pages` pages."""

    def __init__(self, spec: DecoderSpec, config: EngineConfig = EngineConfig(), *,
                 policy=None, widths: tuple = (None,)):
        """config: checked against the decoder here, and kept resolved (`self.config`:
        max_model_len and num_pages filled in); policy: the `SpeculationPolicy` choosing
        widths (None: `widths[0]` always); widths: the verify widths decode calls may take
        (the programs compiled)."""
        max_model_len = config.max_model_len or spec.context
        if not max_model_len <= spec.context:
            raise InputError(f"max_model_len must be in [1, {spec.context}] (the model's "
                             f"context), got {max_model_len}")
        if max_model_len <= spec.extra_capacity + 1:
            raise InputError(f"max_model_len {max_model_len} leaves no room for a prompt and "
                             f"the {spec.extra_capacity}-token verify block")
        per_slot = pages_needed(max_model_len, spec.page_size)
        num_pages = config.num_pages or config.max_slots * per_slot
        if num_pages < per_slot:
            raise InputError(f"num_pages must be at least {per_slot} (one request of "
                             f"max_model_len {max_model_len} in pages of {spec.page_size}), "
                             f"got {num_pages!r}")
        self.config = dataclasses.replace(config, max_model_len=max_model_len,
                                          num_pages=num_pages)
        self.spec = spec
        max_slots = self.max_slots = config.max_slots
        self.max_model_len = max_model_len
        self.max_waiting = config.max_waiting
        self.prefill_chunk = config.prefill_chunk
        self.policy = policy
        self.widths = widths
        self.preemptions = 0
        # off while the engine warms up: those calls are each program's first run over a
        # dummy prompt, neither a cost nor an acceptance
        self.learning = True
        # rows 1, 4, 8, 16, 32, ...: from 8 rows on, padding costs a step or pass in
        # proportion (`row_buckets`)
        self.row_sizes = row_fields.row_buckets(max_slots, doubling_from=8)
        # chunks up to the first that holds the longest prompt (and a token) the context
        # leaves room for: a larger one would never be taken
        chunks = row_fields.row_buckets(config.prefill_chunk, minimum=16)
        longest = max_model_len - spec.extra_capacity - 1
        self.chunk_sizes = chunks[:next(i for i, t in enumerate(chunks)
                                        if t >= longest or t == chunks[-1]) + 1]
        self.pages = SlotPages(max_slots, num_pages, spec.page_size, max_model_len)
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: dict[int, Request] = {}      # slot -> request
        self._by_id: dict[str, Request] = {}
        self._aborted: list[Request] = []           # aborted since the last step
        self._admissions = itertools.count()
        # Each slot's decode row (rows.DECODE_FIELDS), and row S the padding row; a decode
        # call's rows are a gather of it.
        self.idle_rows = np.stack([row_fields.pad_row(row_fields.DECODE_FIELDS, max_slots,
                                                      slot=s) for s in range(max_slots + 1)])
        self._slot_rows = self.idle_rows.copy()
        self._next_passes = spec.steps_per_call     # the next decode call's (set by _grow)

    # ----- requests ------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: Sequence[int], options: SamplingOptions) -> None:
        """Raise InputError for a request this engine can never run (nothing is queued)."""
        options.validate()
        prompt = list(prompt_token_ids)
        if not prompt:
            raise InputError("the prompt is empty after tokenization")
        vocab = self.spec.vocab_size
        bad = [t for t in prompt if not (isinstance(t, (int, np.integer)) and 0 <= t < vocab)]
        if bad:
            raise InputError(f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        bad = [t for t in options.stop_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise InputError(f"stop_token_ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        extra = self.spec.extra_capacity
        need = len(prompt) + options.max_tokens + extra
        if need > self.max_model_len:
            room = self.max_model_len - extra - len(prompt)
            raise InputError(
                f"the prompt has {len(prompt)} tokens and max_tokens is {options.max_tokens}"
                + (f" (plus a {extra}-token verify block)" if extra else "")
                + f": {need} positions, past the engine's context of {self.max_model_len}"
                + (" (the model's)" if self.max_model_len == self.spec.context else "") + ". "
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
        request = Request(request_id, [int(t) for t in prompt_token_ids], options, seed)
        if self.policy is not None:
            request.acceptance = self.policy.new_row()
        self._waiting.append(request)
        self._by_id[request_id] = request

    def abort(self, request_id: str) -> bool:
        """Stop a request; its slot and pages are free for the next step, whose plan
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

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_work(self) -> bool:
        """Requests waiting, in a slot, or aborted and not yet reported."""
        return bool(self._waiting or self._running or self._aborted)

    def used_tokens(self) -> int:
        return sum(r.cache_length() for r in self._running.values())

    # ----- the plan of a step -------------------------------------------------------------
    def schedule(self) -> tuple[list[RequestOutput], list[Call]]:
        """The aborted requests' last outputs, and this step's calls (a prefill chunk,
        then a decode call; either may be absent)."""
        outputs = [output(r, [], [], "abort") for r in self._aborted]
        self._aborted = []
        self._grow()
        self._admit()
        prefill = self._prefill()
        # a request whose prompt this prefill completes decodes in the same step, not a
        # step later (`_grow` or `_admit` took the pages of that decode call)
        decoding = sorted(s for s, r in self._running.items() if r.decoding)
        calls = [c for c in (prefill, self._decode(decoding) if decoding else None)
                 if c is not None]
        return outputs, calls

    def _decode_need(self, request: Request) -> int:
        """Positions a request needs before the next decode call: what its queued calls
        can write and one call more."""
        held = request.cache_bound if request.decoding else len(request.fill)
        return min(held + self._next_passes * self.spec.pass_positions,
                   request.max_positions + self.spec.extra_capacity)

    def _grow(self) -> None:
        """Every request that decodes in this step (decoding, or completing its prompt in
        this step's prefill) holds the pages of its next decode call; the newest requests
        are preempted while the pool is short."""
        decoding = [r for r in self._running.values() if r.decoding or self._starts(r)]
        self._next_passes = self._passes(len(decoding))
        for request in sorted(decoding, key=lambda r: r.order):
            if request.slot < 0:
                continue
            need = self._decode_need(request)
            if self.pages.holds(request.slot, need):
                continue                 # most steps: no page boundary crossed
            while not self.pages.can_fit(request.slot, need):
                victim = max(self._running.values(), key=lambda r: r.order)
                self._preempt(victim)
                if victim is request:
                    break
            else:
                self.pages.resize(request.slot, need)

    def _starts(self, request: Request) -> bool:
        """Whether this step's prefill chunk completes the request's prompt."""
        return not request.decoding and len(request.fill) - request.filled <= self.prefill_chunk

    def _preempt(self, request: Request) -> None:
        """Free the request's slot and pages; it waits at the head of the queue and is
        recomputed from its prompt and the tokens it emitted (the last one becomes the
        anchor again), so nothing is emitted twice."""
        self._release(request)
        self._waiting.appendleft(request)
        self.preemptions += 1

    def _admit(self) -> None:
        while self._waiting and self.pages.free_slots:
            request = self._waiting[0]
            if request.queued:
                break            # preempted with news still queued: they come first
            # a preempted request recomputes its prompt and all but its last token
            request.fill = request.prompt + request.tokens[:-1]
            need = self._decode_need(request)
            if not self.pages.can_fit(None, need):
                break            # oldest first: the head waits for pages, no overtaking
            self._waiting.popleft()
            slot = self.pages.take(need)
            request.slot, request.order = slot, next(self._admissions)
            request.filled, request.decoding = 0, False
            request.read, request.cache_bound = len(request.tokens), 0
            o = request.options
            self._slot_rows[slot] = row_fields.pad_row(
                row_fields.DECODE_FIELDS, self.max_slots, slot=slot,
                temperature=o.temperature, top_p=o.top_p, top_k=o.top_k,
                ignore_eos=o.ignore_eos)
            self._running[slot] = request

    def _release(self, request: Request) -> None:
        """The slot's next request starts from an empty cache on its first prefill chunk,
        and no call computes an idle slot."""
        slot = request.slot
        del self._running[slot]
        self.pages.release(slot)
        self._slot_rows[slot] = self.idle_rows[slot]
        request.slot, request.decoding = -1, False

    def _finish(self, request: Request) -> None:
        """The request is done (or aborted): its slot and pages are free, and news still
        queued for it will be dropped."""
        request.finished = True
        self._by_id.pop(request.request_id, None)
        if request.slot >= 0:
            self._release(request)
        elif request in self._waiting:
            self._waiting.remove(request)

    def _prefill(self) -> Call | None:
        """One chunk for every request still prefilling; those whose prompt is complete
        start decoding."""
        rows = [r for r in self._running.values() if r.filled < len(r.fill)]
        if not rows:
            return None
        g = row_fields.bucket_up(len(rows), self.row_sizes)
        longest = max(len(r.fill) - r.filled for r in rows)
        t = row_fields.bucket_up(min(longest, self.prefill_chunk), self.chunk_sizes)
        matrix = self.prefill_matrix(g, t)
        f = len(row_fields.PREFILL_FIELDS)
        starting: list[Request | None] = [None] * g
        for i, r in enumerate(rows):
            fields, chunk = self._prefill_row(r, t)
            matrix[i, :f], matrix[i, f:f + len(chunk)] = fields, chunk
            if r.decoding:
                starting[i] = r
                r.queued += 1
        return Call("prefill", matrix, starting)

    def prefill_matrix(self, g: int, t: int) -> np.ndarray:
        """[g, F + t] int32: g padding rows (aimed at slot S) of a chunk of t."""
        pad = row_fields.pad_row(row_fields.PREFILL_FIELDS, self.max_slots)
        return np.concatenate([np.tile(pad, (g, 1)), np.zeros((g, t), np.int32)], axis=1)

    def _prefill_row(self, r: Request, t: int) -> tuple[np.ndarray, list[int]]:
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
        return row_fields.pad_row(row_fields.PREFILL_FIELDS, self.max_slots, **values), chunk

    def _decode(self, decoding: list[int]) -> Call:
        """One decode call over the decoding slots only, padded to a bucket of rows."""
        rows = row_fields.bucket_up(len(decoding), self.row_sizes)
        slots = np.full((rows,), self.max_slots, np.int32)     # padding rows aim at slot S
        slots[:len(decoding)] = decoding
        requests = [self._running[s] for s in decoding]
        passes = self._next_passes          # what _grow held pages for
        for r in requests:
            r.queued += 1
            r.cache_bound += passes * self.spec.pass_positions
        return Call("decode", self._slot_rows[slots],
                    requests + [None] * (rows - len(requests)),
                    width=self._width(rows, requests), passes=passes)

    def _passes(self, decoding: int) -> int:
        """Passes of the next decode call: the decoder's most for a row decoding alone
        with nobody waiting, or for the one request an idle engine is about to admit (a
        long call then delays no one, and pays the per-call cost less often), else its
        shared count (a finishing row's slot and a waiting request wait for the call's
        end). While adaptive speculation measures an end of its widths (the first calls
        at a batch size) at most `MEASURING_PASSES`: those calls run a width chosen to be
        timed, not because it pays, and where it does not (the whole block on a CPU
        costs 4.5 plain steps) four calls of 16 passes were most of a 128-token decode."""
        if self.policy is not None and self.policy.measuring(
                row_fields.bucket_up(max(decoding, 1), self.row_sizes), self.widths):
            return min(MEASURING_PASSES, self.spec.shared_steps_per_call)
        if (decoding, len(self._waiting)) in ((1, 0), (0, 1)):
            return self.spec.steps_per_call
        return self.spec.shared_steps_per_call

    def _width(self, rows: int, requests: list[Request]) -> int | None:
        """The verify width of the next decode call over these requests."""
        if self.policy is None:
            return self.widths[0]
        if any(r.options.seed is not None and r.options.temperature > 0 for r in requests):
            return self.widths[-1]          # a seeded sample reproduces at one width only
        return self.policy.choose(rows, [r.acceptance for r in requests],
                                  widths=self.widths)

    # ----- what a call gained -----------------------------------------------------------
    def receive(self, call: Call, news: np.ndarray) -> tuple[list[RequestOutput], int]:
        """Hand each of the call's requests what it gained (news [rows, 3 + W + P], read
        back from the device); finished requests free their slots and pages. -> the
        outputs and the most passes a row ran."""
        outputs, passes = [], 0
        for r, row in zip(call.requests, news.tolist()):   # lists: cheap row slices
            if r is None:
                continue
            r.queued -= 1
            new, accepted, done = self._gained(row)
            passes = max(passes, len(accepted))
            if call.decode:     # its positions are known now: the bound tightens
                r.cache_bound -= call.passes * self.spec.pass_positions - len(new)
            if r.finished:
                continue        # ended or aborted since this call was queued
            reason = None
            stops = r.options.stop_token_ids
            cut = next((i for i, t in enumerate(new) if t in stops), None) if stops else None
            if cut is not None:
                new, reason = new[:cut + 1], "stop"
            elif done:
                last = (r.tokens + new)[-1:]
                hit_eos = last and last[0] in self.spec.eos and not r.options.ignore_eos
                reason = "stop" if hit_eos else "length"
            r.tokens += new
            self._observe_acceptance(r, accepted, call.width, done or reason is not None)
            outputs.append(output(r, new, accepted, reason, call.width))
            if reason is not None:
                self._finish(r)
        return outputs, passes

    def _gained(self, news: list[int]) -> tuple[list[int], list[int], bool]:
        """(tokens, pass lengths, done) a row gained in one call, from its news."""
        width, most = self.spec.news_width
        num, passes, done = news[:3]
        if not (0 <= num <= width and 0 <= passes <= most):
            raise AssertionError(f"a row gained {num} tokens and {passes} passes in one "
                                 f"call; its news hold {width} and {most}")
        return news[3:3 + num], news[3 + width:3 + width + passes], bool(done)

    def _observe_acceptance(self, r: Request, accepted: list[int], width: int | None,
                            finished: bool) -> None:
        """Each pass's accepted drafts into the request's and the pool's statistics (a
        finished request's last pass may be cut by EOS or its budget: not counted)."""
        if self.policy is None or not accepted or not self.learning:
            return
        for length in accepted[:-1] if finished else accepted:
            self.policy.observe_pass(r.acceptance, width, min(length - 1, width))


def output(r: Request, new: list[int], accepted: list[int], reason: str | None,
           width: int | None = None) -> RequestOutput:
    return RequestOutput(request_id=r.request_id, new_token_ids=new,
                         finished=reason is not None, finish_reason=reason,
                         accept_lengths=accepted, prompt_tokens=len(r.prompt),
                         completion_tokens=len(r.tokens), verify_width=width or 0)
