"""The engine core: `add_request` / `abort` / `step` over a fixed set of slots.

In the shape of vLLM's EngineCore: the caller owns the loop (`while core.has_work():
outputs = core.step()`); each `step` applies aborts, admits waiting requests into free
slots, runs one decode call (the decoder's `steps_per_call` target passes) for every
running slot, and returns what each request gained since the last step. One thread drives
it; `dspine_serve.engine_loop` runs it in the server's background thread.

How it sits on today's decoders (`AutoregressiveGenerator`, `SpeculativeEngine`), which
decode a batch that is fixed from prefill to the end:
  * Every slot is the decoder's own batch-of-one `DecodeState` (its own KV page pool of
    `max_model_len` positions, output buffer, acceptance record and RNG key); the slots
    are stacked on a leading axis and the decoder's compiled step loop runs over them
    under `jax.vmap`. Rows never mix, so a request's tokens depend on its own prompt,
    sampling options and seed only: a seeded request gives the same text alone and under
    load (its RNG is its own, not a row of a batch key), and per-row temperature, top-p,
    top-k, max_tokens and ignore_eos come for free.
  * Admission is per step: a waiting request is prefilled (several at once, as one vmapped
    call) and written into a free slot between decode calls; a finished or aborted slot is
    frozen (`done`) and free for the next request at once.
  * What waits for the slot engine on one shared page pool: every slot reserves pages for
    a whole `max_model_len` whether its request uses 20 positions or 2,000 (so capacity
    is slots x max_model_len, not free pages), and every decode call computes all slots,
    running or not. A shared pool admitted by free pages needs the decoders to draw
    samples from per-row RNG keys (`DecodeState.rng` is one key per batch today, which
    is why the slots are vmapped batches of one). This interface (`add_request`, `abort`,
    `step`, `stats`) stays as it is.

Stop token ids and EOS end a request here (the EOS is kept in its tokens, as the library
does); stop strings need text and are applied by the server on detokenized output (it then
calls `abort`). This module never imports the HTTP layer; device arrays never leave it.

Shape legend: S slots, P padded prompt, C cache capacity (max_model_len), G prefill group.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import secrets
import time
import weakref
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspine_jax.decoding import BatchDecoder, DecodeState, bucket
from dspine_jax.errors import InputError
from dspine_jax.kv_cache import pages_needed
from dspine_jax.sampling import SamplingParams, validate_sampling

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


@dataclasses.dataclass
class EngineStats:
    max_slots: int
    running: int
    waiting: int
    capacity_tokens: int    # slots x max_model_len: every slot reserves a whole cache
    used_tokens: int        # prompt + generated positions held by running requests

    @property
    def free_slots(self) -> int:
        return self.max_slots - self.running

    @property
    def cache_usage(self) -> float:
        return self.used_tokens / self.capacity_tokens if self.capacity_tokens else 0.0

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "free_slots": self.free_slots,
                "cache_usage": round(self.cache_usage, 4)}


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: list[int]
    options: SamplingOptions
    seed: int
    slot: int = -1
    read: int = 0            # tokens of the slot's output already returned
    passes_read: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)


class EngineCore:
    """Continuous batching over `max_slots` dense slots of `max_model_len` positions."""

    def __init__(self, decoder: BatchDecoder, *, max_slots: int = 8,
                 max_model_len: int | None = None, max_waiting: int | None = None):
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
        self.decoder = decoder
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.eos = tuple(int(t) for t in np.asarray(decoder.eos).tolist() if t >= 0)
        self._params = decoder.params()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: dict[int, _Request] = {}      # slot -> request
        self._by_id: dict[str, _Request] = {}
        self._aborted: list[_Request] = []           # waiting requests aborted since the step
        self._free = list(range(max_slots))
        # Per-slot sampling settings, host side; sent with every decode call.
        self._temperature = np.zeros((max_slots, 1), np.float32)
        self._top_p = np.ones((max_slots, 1), np.float32)
        self._top_k = np.zeros((max_slots, 1), np.int32)
        self._ignore_eos = np.zeros((max_slots,), bool)
        self._state = self._empty_state()

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
        if need > self.max_model_len:
            room = self.max_model_len - self.decoder.extra_capacity - len(prompt)
            raise InputError(
                f"the prompt has {len(prompt)} tokens and max_tokens is {options.max_tokens}"
                + (f" (plus a {self.decoder.extra_capacity}-token verify block)"
                   if self.decoder.extra_capacity else "")
                + f": {need} positions, past this server's context of {self.max_model_len}. "
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
        self._waiting.append(request)
        self._by_id[request_id] = request

    def abort(self, request_id: str) -> bool:
        """Stop a request; its slot is free for the next step. The next `step` returns its
        last output (finish_reason abort). False if the id is unknown or already done."""
        request = self._by_id.pop(request_id, None)
        if request is None:
            return False
        if request.slot < 0:
            self._waiting.remove(request)
        else:
            self._release(request, freeze=True)
        self._aborted.append(request)
        return True

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._aborted)

    def stats(self) -> EngineStats:
        used = sum(len(r.prompt) + len(r.tokens) for r in self._running.values())
        return EngineStats(max_slots=self.max_slots, running=len(self._running),
                           waiting=len(self._waiting),
                           capacity_tokens=self.max_slots * self.max_model_len,
                           used_tokens=used)

    def step(self) -> list[RequestOutput]:
        outputs = [self._output(r, [], [], "abort") for r in self._aborted]
        self._aborted = []
        admitted = self._admit()
        if self._running and (len(admitted) < len(self._running)):
            self._decode()           # fresh rows already hold their first token
        if self._running:
            outputs += self._collect()
        return outputs

    # ----- slots -------------------------------------------------------------------------
    def _admit(self) -> list[_Request]:
        group = []
        while self._waiting and self._free:
            request = self._waiting.popleft()
            request.slot = self._free.pop(0)
            group.append(request)
        if not group:
            return group
        g = min(bucket(len(group), minimum=1), self.max_slots)
        p = bucket(max(len(r.prompt) for r in group))
        p = min(p, self.max_model_len)
        tokens = np.zeros((g, 1, p), np.int32)
        lengths = np.ones((g, 1), np.int32)
        budget = np.ones((g, 1), np.int32)
        seeds = np.zeros((g,), np.uint32)
        temperature = np.zeros((g, 1), np.float32)
        top_p = np.ones((g, 1), np.float32)
        top_k = np.zeros((g, 1), np.int32)
        ignore = np.zeros((g,), bool)
        slots = np.full((g,), self.max_slots, np.int32)   # padding rows are dropped
        for i, r in enumerate(group):
            o = r.options
            tokens[i, 0, :len(r.prompt)] = r.prompt
            lengths[i], budget[i], slots[i] = len(r.prompt), o.max_tokens, r.slot
            temperature[i], top_p[i], top_k[i], ignore[i] = (o.temperature, o.top_p, o.top_k,
                                                              o.ignore_eos)
            seeds[i] = r.seed % (2 ** 32)
            self._temperature[r.slot], self._top_p[r.slot] = o.temperature, o.top_p
            self._top_k[r.slot], self._ignore_eos[r.slot] = o.top_k, o.ignore_eos
            self._running[r.slot] = r
        # Prefill traces sampling even for greedy groups (argmax rows stay argmax): one
        # token per row costs little, and it halves the prefill variants to compile.
        sampling = SamplingParams(jnp.asarray(temperature), jnp.asarray(top_p),
                                  jnp.asarray(top_k), all_greedy=False)
        self._state = self._prefill_fn()(self._params, self._state, jnp.asarray(tokens),
                              jnp.asarray(lengths), jnp.asarray(budget), jnp.asarray(seeds),
                              sampling, jnp.asarray(ignore), jnp.asarray(slots))
        return group

    def _decode(self) -> None:
        greedy = bool((self._temperature == 0).all())
        sampling = SamplingParams(jnp.asarray(self._temperature), jnp.asarray(self._top_p),
                                  jnp.asarray(self._top_k), all_greedy=greedy)
        self._state = self._decode_fn()(self._params, self._state, sampling,
                                              jnp.asarray(self._ignore_eos))

    def _collect(self) -> list[RequestOutput]:
        s = self._state
        num, done, output, passes, lengths = jax.device_get(
            (s.num_generated[:, 0], s.done[:, 0], s.output[:, 0], s.num_passes[:, 0],
             s.pass_lengths[:, 0]))
        outputs = []
        for slot, r in list(self._running.items()):
            new = output[slot, r.read:num[slot]].tolist()
            accepted = lengths[slot, r.passes_read:passes[slot]].tolist()
            reason = None
            cut = next((i for i, t in enumerate(new) if t in r.options.stop_token_ids), None)
            if cut is not None:
                new, reason = new[:cut + 1], "stop"
            elif done[slot]:
                last = (r.tokens + new)[-1:]
                hit_eos = last and last[0] in self.eos and not r.options.ignore_eos
                reason = "stop" if hit_eos else "length"
            r.read, r.passes_read = int(num[slot]), int(passes[slot])
            r.tokens += new
            outputs.append(self._output(r, new, accepted, reason))
            if reason is not None:
                self._by_id.pop(r.request_id, None)
                # A stop token ends the row on the host: freeze it on the device too.
                self._release(r, freeze=not done[slot])
        return outputs

    def _release(self, request: _Request, *, freeze: bool) -> None:
        slot = request.slot
        del self._running[slot]
        self._temperature[slot], self._top_p[slot], self._top_k[slot] = 0.0, 1.0, 0
        self._ignore_eos[slot] = False
        if freeze:
            self._state = self._freeze_fn()(self._state, jnp.asarray([slot], jnp.int32))
        self._free.append(slot)
        self._free.sort()

    @staticmethod
    def _output(r: _Request, new: list[int], accepted: list[int],
                reason: str | None) -> RequestOutput:
        return RequestOutput(request_id=r.request_id, new_token_ids=new,
                             finished=reason is not None, finish_reason=reason,
                             accept_lengths=accepted, prompt_tokens=len(r.prompt),
                             completion_tokens=len(r.tokens))

    # ----- compiled pieces: the decoder's own prefill and step loop, per slot ------------
    def _row_prefill(self, params, tokens, length, budget, seed, sampling, ignore):
        return _row_prefill(self.decoder, self.max_model_len, params, tokens, length, budget,
                            seed, sampling, ignore)

    def _empty_state(self) -> DecodeState:
        """S frozen (done) slots with the shapes a prefilled slot has."""
        one = jax.eval_shape(
            self._row_prefill, self._params, jnp.zeros((1, 16), jnp.int32),
            jnp.ones((1,), jnp.int32), jnp.ones((1,), jnp.int32), jnp.uint32(0),
            SamplingParams.create(1), jnp.asarray(False))

        def zeros(leaf):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                return jax.random.split(jax.random.key(0), (self.max_slots,) + leaf.shape)
            return jnp.zeros((self.max_slots,) + leaf.shape, leaf.dtype)

        state = jax.tree.map(zeros, one)
        return state.replace(done=jnp.ones_like(state.done))

    def _prefill_fn(self):
        return _compiled(self.decoder, ("prefill", self.max_model_len), lambda: jax.jit(
            functools.partial(_prefill, self.decoder, self.max_model_len),
            donate_argnames=("state",)))

    def _decode_fn(self):
        return _compiled(self.decoder, ("decode",), lambda: jax.jit(
            jax.vmap(functools.partial(_row_decode, self.decoder), in_axes=(None, 0, 0, 0)),
            donate_argnames=("state",)))

    def _freeze_fn(self):
        return _compiled(self.decoder, ("freeze",), lambda: jax.jit(
            _freeze, donate_argnames=("state",)))

    def warmup(self) -> float:
        """Compile before serving: the decode loop (greedy and sampled) and the prefill of
        one request and of a full set of slots, at the shortest prompt bucket (longer
        buckets and other group sizes compile when first met). Returns seconds."""
        t0 = time.perf_counter()
        n = max(1, min(8, self.max_model_len - self.decoder.extra_capacity - 2))
        for temperature, group in ((0.0, 1), (1.0, self.max_slots)):
            for i in range(group):
                self.add_request(f"__warmup_{temperature}_{i}", [0] * n, SamplingOptions(
                    max_tokens=2, temperature=temperature, seed=0, ignore_eos=True))
            while self.has_work():
                self.step()
        return time.perf_counter() - t0


class QueueFull(InputError):
    """The waiting queue is at its bound: the server answers 429."""



# Compiled functions live with their decoder, not with one EngineCore: a server restarted
# in-process (or several cores over one pipeline) compiles nothing twice. jax.jit keys
# each on its input shapes (slots, group, prompt bucket) and on `all_greedy`.
_COMPILED: "weakref.WeakKeyDictionary[BatchDecoder, dict]" = weakref.WeakKeyDictionary()


def _compiled(decoder: BatchDecoder, key: tuple, make):
    table = _COMPILED.setdefault(decoder, {})
    if key not in table:
        table[key] = make()
    return table[key]


def _row_prefill(decoder: BatchDecoder, capacity: int, params, tokens, length, budget, seed,
                 sampling, ignore):
    """One request as the decoder's batch of one: tokens [1, P] -> DecodeState (B = 1),
    its caches a private page pool holding the slot's whole capacity (pages 0 .. PPS-1)."""
    width = pages_needed(capacity, decoder.page_size)
    caches = decoder.create_caches(np.arange(width, dtype=np.int32)[None], width)
    return decoder._prefill_fn(params, tokens, length, caches, sampling, budget,
                               jax.random.key(seed), ignore, capacity)


def _prefill(decoder, capacity, params, state, tokens, lengths, budget, seeds, sampling,
             ignore, slots):
    """Prefill G requests [G, 1, P] (vmapped rows of one) and write them into `slots` [G]
    of the S-slot state; rows aimed at slot S (padding) are dropped."""
    row = jax.vmap(functools.partial(_row_prefill, decoder, capacity),
                   in_axes=(None, 0, 0, 0, 0, 0, 0))
    new = row(params, tokens, lengths, budget, seeds, sampling, ignore)
    return jax.tree.map(lambda s, n: s.at[slots].set(n, mode="drop"), state, new)


def _row_decode(decoder, params, state, sampling, ignore):
    """The decoder's step loop (steps_per_call target passes) on one slot."""
    return decoder._decode_fn(params, state, sampling, ignore, decoder.steps_per_call)


def _freeze(state, slots):
    return state.replace(done=state.done.at[slots].set(True))
