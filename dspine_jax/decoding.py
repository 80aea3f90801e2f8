"""What every decoder shares: request checks, shape buckets, ahead-of-time compilation,
the device-side step loop, token emission (EOS, budget) and the host streaming loop.

A decoder defines three things: the caches it needs, a `prefill` that writes a chunk of
tokens into them and returns the logits after each row's last one, and one `step` (one
target pass) that proposes tokens for `emit`. Around them sits the step API that both
front ends drive, offline `generate`/`stream` here and the serving engine core:

  prefill(params, tokens, q_lens, caches)   a chunk [B, T] after what the caches hold
  start(state, rows, logits, ...)           rows begin decoding: the first token sampled
                                            from the prefill's logits, or a preempted
                                            request's last token taken back as the anchor
  decode(params, state, sampling, ...)      up to `num_steps` steps in a `lax.while_loop`
  call_lookahead                            cache positions one decode call can write

Randomness is per row: `DecodeState.rng` holds one key per row, and a row's step draws
from its key folded with its token count (`step_keys`), so its samples depend on its own
seed and progress only, never on its neighbours, its row index or a preemption.

Caches are paged: every model's cache shares one page table. Offline batches get a page
pool each (host bookkeeping in `PagePool`; every row's pages for its prompt, budget and
the step's extra positions are allocated up front); the serving engine shares one pool
between its slots and grows rows as they decode. Attention runs on the decoder's
`attention` backend. Offline, prefill and the step loop are compiled once per shape bucket
(batch, prompt length and budget rounded up to powers of two), before timing starts, so
`seconds` never includes compilation. `steps_per_call` steps run per host call, and
`stream` queues each call before it reads the last one's tokens (`decode_with_news`).

Shape legend: B batch, P padded prompt, T prefill chunk, G rows started, N output buffer,
E tokens a step may emit, V vocab.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import time
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dspine_jax import row_keys
from dspine_jax.attention import AttentionBackend, select_backend
from dspine_jax.errors import InputError
from dspine_jax.kv_cache import DEFAULT_PAGE_SIZE, PagePool, pages_needed
from dspine_jax.sampling import SamplingParams, sample_tokens
from dspine_jax.target import TargetModel
from pallas_kernels.switches import Switches

MIN_BUCKET = 16


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Round up to a power of two so a handful of shapes cover every request."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def padded_batch(prompts: list, size: int) -> list:
    """Fill a short batch up to `size` rows with copies of its last prompt, so every batch
    of a long job reuses one compiled shape (callers drop the extra rows' outputs)."""
    return list(prompts) + [prompts[-1]] * (size - len(prompts))


def mean_accept_length(accept_lengths: Sequence[int]) -> float:
    """Tokens emitted per target verify pass, bonus included (1.0 for AR).

    With no pass at all (prefill's token was the only one: max_new_tokens=1, or EOS first)
    the ratio is 0/0; we report 0.0, not 1.0, because no pass accepted anything and 1.0
    would pass for a real AR-level measurement when averaged into a table."""
    return sum(accept_lengths) / len(accept_lengths) if len(accept_lengths) else 0.0


@struct.dataclass
class DecodeState:
    caches: tuple             # the decoder's caches (target KV, drafter context, ...)
    last_token: jax.Array     # [B] the token emitted last: the next step's input
    output: jax.Array         # [B, N] emitted tokens
    num_generated: jax.Array  # [B]
    done: jax.Array           # [B] bool
    budget: jax.Array         # [B] max new tokens per row
    pass_lengths: jax.Array   # [B, N] tokens emitted by each target pass after prefill
    num_passes: jax.Array     # [B]
    rng: jax.Array            # [B] keys, one per row (`step_keys` derives each step's)


@dataclasses.dataclass
class Generation:
    tokens: list[int]          # generated ids only (EOS included when it ended the row)
    prompt_tokens: int
    finish_reason: str         # "stop" (EOS) or "length"
    accept_lengths: list[int]  # tokens emitted per target pass after prefill
    # passes per verify width (drafts verified per pass; 0 is a plain AR step)
    verify_widths: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def mean_accept_length(self) -> float:
        return mean_accept_length(self.accept_lengths)


@dataclasses.dataclass
class PreparedBatch:
    prefill: Callable[[], DecodeState]
    # steps_per_call target passes per call, verifying `width` drafts each (None: the
    # decoder's widest); a width is compiled the first time it is asked for
    decode: Callable[..., DecodeState]
    # the same call, also returning News: what the host streams, in buffers of their own
    decode_with_news: Callable[..., tuple[DecodeState, "News"]]
    compile_seconds: float


# num_generated [B], done [B], output [B, N], num_passes [B], pass_lengths [B, N]
News = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]


@dataclasses.dataclass
class BatchResult:
    generations: list[Generation]
    seconds: float             # prefill + decode wall time, compilation excluded
    compile_seconds: float
    prefill_seconds: float = 0.0  # of `seconds`: until the prefill's first tokens are read


def request_keys(seeds: jax.Array, rows: jax.Array) -> jax.Array:
    """[B] keys: key(seed) folded with the row index. Offline rows are 0..B-1; a served
    request is row 0, so it samples as `generate` does for one prompt with its seed."""
    return row_keys.fold_in(row_keys.row_keys(seeds), rows)


def step_keys(state: DecodeState) -> jax.Array:
    """[B] fresh keys for this step: each row's key folded with its token count (which
    every active step raises, so no key repeats; prefill's draw uses count 0)."""
    return row_keys.fold_in(state.rng, state.num_generated)


def emit(state: DecodeState, tokens: jax.Array, count: jax.Array, next_input: jax.Array,
         eos: jax.Array, ignore_eos) -> DecodeState:
    """Append tokens[:, :count] [B, E] to each active row, cut at the first EOS and at
    the budget; finished rows change nothing."""
    b, e = tokens.shape
    active = ~state.done
    j = jnp.arange(e)[None, :]
    ignore = jnp.asarray(ignore_eos)
    ignore = ignore[:, None] if ignore.ndim == 1 else ignore   # per row [B] or one flag
    is_eos = jnp.any(tokens[..., None] == eos, -1) & (j < count[:, None]) & ~ignore
    hit = jnp.any(is_eos, -1)
    count = jnp.where(hit, jnp.argmax(is_eos, -1) + 1, count)
    count = jnp.minimum(count, state.budget - state.num_generated)
    count = jnp.where(active, count, 0)
    slots = jnp.where(j < count[:, None], state.num_generated[:, None] + j, state.output.shape[1])
    rows = jnp.arange(b)[:, None]
    output = state.output.at[rows, slots].set(tokens, mode="drop")
    num = state.num_generated + count
    pass_slot = jnp.where(active, state.num_passes, state.pass_lengths.shape[1])
    return state.replace(
        output=output, num_generated=num,
        done=state.done | (active & (hit | (num >= state.budget))),
        last_token=jnp.where(active, next_input, state.last_token),
        pass_lengths=state.pass_lengths.at[jnp.arange(b), pass_slot].set(count, mode="drop"),
        num_passes=state.num_passes + active)


class BatchDecoder:
    """Base of the autoregressive generator and the speculative engine."""

    extra_capacity = 0  # cache positions a step writes past the last emitted token

    def __init__(self, target: TargetModel, *, eos_token_ids: Sequence[int] = (),
                 steps_per_call: int = 8, shared_steps_per_call: int | None = None,
                 attention_backend: str | AttentionBackend | None = "auto",
                 page_size: int = DEFAULT_PAGE_SIZE, num_pages: int | None = None,
                 switches: Switches | None = None):
        """attention_backend: "auto" (pallas where the platform compiles it, else xla),
        "pallas", "xla" or an AttentionBackend. num_pages: the page pool's size per batch
        (default: enough for every row at the batch's capacity). switches: the kernel and
        search variants every program of this decoder is traced with (default: the
        DSPINE_* variables, read now; `pallas_kernels.switches`). steps_per_call: target
        passes per decode call (at most, in the slot engine); shared_steps_per_call: the
        slot engine's passes per call while several rows decode or requests wait (default
        and at most steps_per_call)."""
        for name, value in (("steps_per_call", steps_per_call),
                            ("shared_steps_per_call", shared_steps_per_call)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        self.switches = switches or Switches.from_environment()
        self.config = target.config
        self.dtype = target.dtype
        self.page_size = page_size
        self.num_pages = num_pages
        self.attention = select_backend(attention_backend, self.attention_configs(target),
                                        dtype=target.dtype, page_size=page_size)
        self.target_graph, self.target_params = nnx.split(target)
        self.eos = jnp.asarray(list(eos_token_ids) or [-1], jnp.int32)
        self.steps_per_call = steps_per_call
        self.shared_steps_per_call = min(shared_steps_per_call or steps_per_call,
                                         steps_per_call)
        self._compiled: dict[tuple, Callable] = {}
        self.compile_clock = 0.0   # seconds spent compiling, all programs

    # ----- what a decoder defines --------------------------------------------------------
    def params(self) -> tuple:
        return (self.target_params,)

    def attention_configs(self, target: TargetModel) -> list:
        """Layer configs of every model whose attention runs on the backend."""
        return [target.config]

    def create_caches(self, page_table: np.ndarray, num_pages: int) -> tuple:
        """Empty caches over one page table [B, PPS] of a pool of num_pages pages."""
        raise NotImplementedError

    def prefill(self, params, tokens, q_lens, caches):
        """Write tokens [B, T] (the first q_lens[b] of row b are real; 0 writes nothing)
        after what each row's caches hold. -> (logits [B, V] float32 after each row's last
        real token, the caches)."""
        raise NotImplementedError

    def step(self, params, state: DecodeState, sampling, ignore_eos,
             width: int | None = None) -> DecodeState:
        """One target pass: propose tokens and `emit` them; a speculative decoder verifies
        `width` drafts (None: its widest)."""
        raise NotImplementedError

    def target(self, params):
        return nnx.merge(self.target_graph, params[0])

    # ----- the step API (offline batches and the serving engine) -------------------------
    @property
    def pass_positions(self) -> int:
        """Cache positions one step can write past a row's length (and advance it by)."""
        return max(1, self.extra_capacity)

    @property
    def call_lookahead(self) -> int:
        """Cache positions one decode call (steps_per_call steps) can write past a row's
        length."""
        return self.steps_per_call * self.pass_positions

    @staticmethod
    def with_page_table(caches: tuple, page_table: jax.Array) -> tuple:
        """Every cache over one page table [B, PPS] (the models share their pages)."""
        return tuple(c.replace(page_table=page_table) for c in caches)

    @staticmethod
    def empty_state(caches: tuple, out_len: int) -> DecodeState:
        """B idle (done) rows over caches of B rows, with an output buffer of out_len."""
        b = caches[0].batch_size
        # a buffer per field: the engine core donates the state, and a buffer donated
        # twice in one call is an error
        zeros = lambda *shape: jnp.zeros((b,) + shape, jnp.int32)  # noqa: E731
        return DecodeState(
            caches=caches, last_token=zeros(), output=zeros(out_len), num_generated=zeros(),
            done=jnp.ones((b,), bool), budget=zeros(), pass_lengths=zeros(out_len),
            num_passes=zeros(), rng=row_keys.row_keys(zeros()))

    def start(self, state: DecodeState, rows, logits, sampling, budget, rng, ignore_eos,
              resume_token=None, resume_count=None) -> DecodeState:
        """Rows [G] of `state` (their prompts already prefilled) begin decoding; rows equal
        to B (padding) are dropped. A fresh row (resume_token < 0) samples its first token
        from logits [G, V] and emits it; a resumed row (a preempted request recomputed
        from its prompt and all but its last token) takes resume_token [G] back as its
        anchor with resume_count [G] tokens already emitted, and emits nothing.
        budget [G], rng [G] keys, sampling and ignore_eos per row of the G."""
        g, n_out = rows.shape[0], state.output.shape[1]
        if resume_token is None:
            resume_token = jnp.full((g,), -1, jnp.int32)
            resume_count = jnp.zeros((g,), jnp.int32)
        fresh = resume_token < 0
        zeros = jnp.zeros((g,), jnp.int32)
        sampled = sample_tokens(logits, sampling, row_keys.fold_in(rng, zeros))
        first = jnp.where(fresh, sampled, resume_token)
        new = DecodeState(
            caches=(), last_token=first, output=jnp.zeros((g, n_out), jnp.int32),
            num_generated=jnp.where(fresh, 0, resume_count), done=jnp.zeros((g,), bool),
            budget=budget, pass_lengths=jnp.zeros((g, n_out), jnp.int32), num_passes=zeros,
            rng=rng)
        new = emit(new, first[:, None], fresh.astype(jnp.int32), first, self.eos, ignore_eos)
        new = new.replace(num_passes=zeros)                           # prefill is no pass
        put = lambda old, x: old.at[rows].set(x, mode="drop")        # noqa: E731
        return jax.tree.map(put, state.replace(caches=()), new).replace(caches=state.caches)

    def decode(self, params, state: DecodeState, sampling, ignore_eos,
               num_steps: int, width: int | None = None) -> DecodeState:
        """Up to num_steps steps (fewer once every row is done), each of verify `width`."""
        def body(carry):
            i, s = carry
            return i + 1, self.step(params, s, sampling, ignore_eos, width)

        _, state = jax.lax.while_loop(lambda c: (c[0] < num_steps) & ~jnp.all(c[1].done), body,
                                      (jnp.int32(0), state))
        return state

    def decode_with_news(self, params, state: DecodeState, sampling, ignore_eos,
                         num_steps: int, width: int | None = None) -> tuple[DecodeState, News]:
        """`decode`, and the News the host streams: output buffers of their own, still
        readable after the next call has taken `state` (donated)."""
        state = self.decode(params, state, sampling, ignore_eos, num_steps, width)
        return state, (state.num_generated, state.done, state.output, state.num_passes,
                       state.pass_lengths)

    # ----- compiled pieces (offline batches) ----------------------------------------------
    def _prefill_batch(self, params, tokens, lengths, page_table, sampling, budget, rng,
                       ignore_eos, num_pages, out_len):
        # the empty caches are built inside the compiled program: built eagerly, one
        # dispatch per layer's pool, they cost more host time than the prefill itself
        caches = self.create_caches(page_table, num_pages)
        logits, caches = self.prefill(params, tokens, lengths, caches)
        state = self.empty_state(caches, out_len)
        rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        return self.start(state, rows, logits, sampling, budget, rng, ignore_eos)

    def _compile(self, key, fn, *args, static=(), donate=()):
        if key not in self._compiled:
            t0 = time.perf_counter()
            jitted = jax.jit(fn, static_argnames=static, donate_argnames=donate)
            with self.switches.active():
                self._compiled[key] = jitted.lower(*args).compile()
            self.compile_clock += time.perf_counter() - t0
        return self._compiled[key]

    # ----- public API ----------------------------------------------------------------------
    def check_request(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        if not prompts:
            raise InputError("no prompts given")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        context = self.config.max_position_embeddings
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise InputError(f"prompt {i} is empty after tokenization")
            if len(p) + max_new_tokens + self.extra_capacity > context:
                raise InputError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens}"
                    + (f" and a {self.extra_capacity}-token verify block"
                       if self.extra_capacity else "")
                    + f" it needs {len(p) + max_new_tokens + self.extra_capacity} positions, "
                    f"past the model's context of {context}. Shorten the prompt or lower "
                    "max_new_tokens.")
            bad = [t for t in p if not 0 <= t < self.config.vocab_size]
            if bad:
                raise InputError(f"prompt {i} has token ids outside the vocabulary "
                                 f"[0, {self.config.vocab_size}): {bad[:5]}")

    def bucket_shape(self, prompts: Sequence[Sequence[int]],
                     max_new_tokens: int) -> tuple[int, int, int, int]:
        """(rows, padded prompt length, output buffer, cache capacity): the shape bucket a
        request's programs are compiled for (with its sampling's static flags)."""
        longest = max(len(p) for p in prompts)
        capacity = min(bucket(longest + max_new_tokens + self.extra_capacity),
                       self.config.max_position_embeddings)
        return len(prompts), bucket(longest), bucket(max_new_tokens), capacity

    def prepare(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
                temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                seed: int = 0, ignore_eos: bool = False) -> PreparedBatch:
        """Check the request, pad it into its shape bucket and compile (once per bucket).
        Returns the two stages as closures so callers (and benchmarks) can drive them."""
        self.check_request(prompts, max_new_tokens)
        b, prompt_len, out_len, capacity = self.bucket_shape(prompts, max_new_tokens)
        with self.switches.active():                    # the sampling mode reads them
            sampling = SamplingParams.create(b, temperature, top_p, top_k)
        page_table, num_pages = self.allocate_pages(prompts, max_new_tokens, capacity)
        tokens = np.zeros((b, prompt_len), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
        budget = jnp.full((b,), max_new_tokens, jnp.int32)
        rows = jnp.arange(b, dtype=jnp.int32)
        rng = request_keys(jnp.full((b,), seed % 2 ** 32, jnp.uint32), rows)
        ignore = jnp.asarray(ignore_eos)
        params = self.params()

        args = (params, tokens, lengths, page_table, sampling, budget, rng, ignore)

        t0 = time.perf_counter()
        # greedy batches trace no sampling at all, unfiltered ones no vocabulary threshold
        shape = (b, capacity, num_pages, out_len, sampling.all_greedy, sampling.all_unfiltered)
        # the prefill builds the page pools itself: none is allocated until it runs
        prefill = self._compile(("prefill", prompt_len) + shape, self._prefill_batch,
                                *args, num_pages, out_len, static=("num_pages", "out_len"))
        with self.switches.active():
            state = jax.eval_shape(functools.partial(self._prefill_batch, num_pages=num_pages,
                                                     out_len=out_len), *args)
        def decode(width: int | None):
            """The decode program of one verify width, compiled on first use."""
            width = self.default_width() if width is None else width
            return self._compile(("decode", width) + shape, self.decode_with_news, params,
                                 state, sampling, ignore, self.steps_per_call, width,
                                 static=("num_steps", "width"), donate=("state",))

        decode(self.default_width())
        return PreparedBatch(
            prefill=lambda: prefill(*args),
            decode=lambda s, width=None: decode(width)(params, s, sampling, ignore)[0],
            decode_with_news=lambda s, width=None: decode(width)(params, s, sampling, ignore),
            compile_seconds=time.perf_counter() - t0)

    def default_width(self) -> int | None:
        """The width a call runs when none is asked for (None: the decoder has one)."""
        return None

    def allocate_pages(self, prompts, max_new_tokens: int, capacity: int):
        """Every row's pages for its prompt, budget and extra positions, from one pool.
        -> (page table [B, PPS] with PPS = capacity / page size, the pool's size)."""
        width = pages_needed(capacity, self.page_size)
        pool = PagePool(self.num_pages or len(prompts) * width, self.page_size)
        for row, p in enumerate(prompts):
            pool.allocate(row, min(len(p) + max_new_tokens + self.extra_capacity, capacity))
        return pool.page_table(range(len(prompts)), width), pool.num_pages

    def generate(self, prompts: Sequence[Sequence[int]], *,
                 on_tokens: Callable[[int, list[int]], None] | None = None,
                 **options) -> BatchResult:
        """Generate for a batch of token-id prompts; `on_tokens(row, new_ids)` streams.
        Options: max_new_tokens, temperature, top_p, top_k, seed, ignore_eos."""
        events = self.stream(prompts, **options)
        while True:
            try:
                row, ids = next(events)
            except StopIteration as finished:
                return finished.value
            if on_tokens is not None:
                on_tokens(row, ids)

    def stream(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
               ignore_eos: bool = False) -> Iterator[tuple[int, list[int]]]:
        """Yield (row, new token ids) as they arrive; the generator returns the BatchResult."""
        run = self.prepare(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                           top_p=top_p, top_k=top_k, seed=seed, ignore_eos=ignore_eos)
        b = len(prompts)
        widths = WidthChooser(self.speculation_policy(), b, self.default_width())
        compiled_before = self.compile_clock
        t0 = time.perf_counter()
        state = run.prefill()
        num, done, output = jax.device_get((state.num_generated, state.done, state.output))
        prefill_seconds = time.perf_counter() - t0
        emitted = [0] * b

        def stream_news():
            nonlocal emitted
            for row in range(b):
                if num[row] > emitted[row]:
                    yield row, output[row, emitted[row]:num[row]].tolist()
            emitted = num.tolist()

        yield from stream_news()
        if not done.all():
            # One call ahead of the host: the next call is queued before the host reads and
            # streams the last one's news, so the device does not idle while the host
            # syncs, streams and dispatches (about 2 ms a call on an H200's host). The call
            # queued after every row is done runs no step. Its verify width is chosen from
            # what the calls read so far (one call behind).
            # DSPINE_STREAM_AHEAD=0 reads each call before queuing the next (before/after).
            ahead = os.environ.get("DSPINE_STREAM_AHEAD", "1") != "0"

            def dispatch(state):
                width = widths.choose(done)
                call = run.decode_with_news(state, width)
                widths.dispatched(width, self.compile_clock)
                return call

            state, news = dispatch(state)
            while True:
                following = dispatch(state) if ahead else None
                num, done, output, passes, lengths = jax.device_get(news)
                widths.read(passes, lengths, done, self.compile_clock)
                yield from stream_news()
                if done.all():
                    state = following[0] if following else state  # `state` went to it
                    break
                state, news = following or dispatch(state)
        lazy_compile = self.compile_clock - compiled_before     # widths first run mid-stream
        seconds = time.perf_counter() - t0 - lazy_compile
        self.finished_batch()
        passes, lengths = jax.device_get((state.num_passes, state.pass_lengths))

        eos = set(np.asarray(self.eos).tolist())
        generations = []
        for row in range(b):
            ids = output[row, :num[row]].tolist()
            reason = "stop" if ids and ids[-1] in eos and not ignore_eos else "length"
            generations.append(Generation(tokens=ids, prompt_tokens=len(prompts[row]),
                                          finish_reason=reason,
                                          accept_lengths=lengths[row, :passes[row]].tolist(),
                                          verify_widths=widths.row_widths(row)))
        return BatchResult(generations=generations, seconds=seconds,
                           compile_seconds=run.compile_seconds + lazy_compile,
                           prefill_seconds=prefill_seconds)

    def speculation_policy(self):
        """The `SpeculationPolicy` choosing verify widths, or None (one width only)."""
        return None

    def finished_batch(self) -> None:
        """A batch's stream ended (the speculative engine saves what its policy measured)."""


class WidthChooser:
    """One static batch's verify widths: asks the policy before each call and feeds it
    each call's wall time and acceptance once read. Calls are queued one ahead, so a call's
    time is taken from the previous read to its own; a call during which a program was
    compiled is not timed."""

    def __init__(self, policy, rows: int, default: int | None):
        self.policy, self.rows, self.default = policy, rows, default
        self.stats = [policy.new_row() for _ in range(rows)] if policy else []
        self.queue: list[int | None] = []         # widths of calls dispatched, not yet read
        self.passes = np.zeros(rows, np.int64)    # passes each row had at the last read
        self.per_row = [collections.Counter() for _ in range(rows)]
        self.last_read = None
        self.compiled_at_read = 0.0

    def choose(self, done) -> int | None:
        if self.policy is None:
            return self.default
        return self.policy.choose(self.rows, [s for s, d in zip(self.stats, done) if not d])

    def dispatched(self, width, compile_clock: float) -> None:
        """A call of `width` was queued (behind the ones not yet read)."""
        self.queue.append(width)
        if self.last_read is None:
            self.last_read, self.compiled_at_read = time.perf_counter(), compile_clock

    def read(self, passes, lengths, done, compile_clock: float) -> None:
        now = time.perf_counter()
        width = self.queue.pop(0)
        ran = passes - self.passes
        for row in np.nonzero(ran)[0]:
            self.per_row[row][width] += int(ran[row])
            if self.policy is not None:
                # a finished row's last pass may be cut by EOS or the budget: not counted
                last = passes[row] - (1 if done[row] else 0)
                for p in range(self.passes[row], last):
                    self.policy.observe_pass(self.stats[row], width,
                                             min(int(lengths[row, p]) - 1, width))
        if self.policy is not None and compile_clock == self.compiled_at_read:
            self.policy.observe_call(self.rows, width, now - self.last_read, int(ran.max()))
        self.passes = np.asarray(passes, np.int64).copy()
        self.last_read, self.compiled_at_read = now, compile_clock

    def row_widths(self, row: int) -> dict[int, int]:
        """{verify width: passes} of one row (AR: {0: passes}); {} before any pass."""
        return {(0 if w is None else w): n for w, n in sorted(
            self.per_row[row].items(), key=lambda kv: -1 if kv[0] is None else kv[0])}
