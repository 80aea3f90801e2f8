"""The engine core's compiled calls over its slots: one `DecodeState` of S rows whose
caches (target KV, drafter context) share one page pool, driven through the decoder's
public step API (`prefill`, `start`, `decode`).

  prefill_rows   one prefill chunk for G slots; slots whose prompt is then complete start
                 decoding (first token sampled, or a preempted request's anchor taken back)
  decode_rows    one decode call (up to steps_per_call target passes) over the R decoding
                 slots, gathered into R rows (a power-of-two bucket) and scattered back

The page table lives on the host (`slots.SlotPages`) and comes with every call, so a row's
growth, preemption or release never recompiles anything. A released slot needs no device
call: its next request's first prefill chunk starts from an empty cache.

Host work per call is kept small (the engine queues a step's calls before it reads the
last step's, so host work hides behind the device only while it is shorter than a call):
  * a call's per-row arguments travel as one int32 matrix (`rows.pad_row`, `unpack_rows`;
    floats as their bits), one host-to-device copy instead of one per argument, and the
    page table is uploaded only when it changed;
  * the weights travel as a flat tuple of arrays: flattening the decoder's nnx state
    (hundreds of Variables, in Python) took 0.26 ms per call for SmolLM2 + DSpine on
    the CPU, against 9 us for the tuple;
  * each call also returns, for its rows, the tokens and pass lengths that call emitted
    (`news`), so a step reads one small array back, not five arrays among them the
    [S, N] output and pass-length buffers, and the host keeps no read cursor that the
    next call would need.

Compiled functions live with their decoder, not with one EngineCore: a server restarted
in-process (or several cores over one pipeline) compiles nothing twice. Calls are padded
to a few sizes (`rows.row_buckets`: R and G 1, 4, then powers of 2 from 8; T from 16 in
powers of 4 up to the prefill chunk or the longest prompt), each compiled ahead of time
per (size, sampling mode, width) key in parallel: at start-up those that run any request,
the others in the background (`compile_later`).

Shape legend: S slots, R decoding rows in a decode call (bucketed), G rows in a prefill
call, T prefill chunk, F fields of a row, PPS pages per slot, W tokens and P passes a
step can emit per row.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
import time

import jax
import jax.numpy as jnp

from dspine_jax import compile_cache, program_store
from dspine_jax.decoding import BatchDecoder, DecodeState, request_keys
from dspine_jax.runtime.rows import (BOOL_FIELDS, DECODE_FIELDS, FLOAT32_FIELDS, PREFILL_FIELDS,
                                     UINT32_FIELDS)
from dspine_jax.sampling import params_for_mode

log = logging.getLogger(__name__)


def unpack_rows(rows: jax.Array, fields: tuple[str, ...]) -> dict[str, jax.Array]:
    """Row matrix [n, >= F] -> {field: [n]} in each field's own dtype."""
    out = {}
    for i, name in enumerate(fields):
        x = rows[:, i]
        if name in FLOAT32_FIELDS:
            x = jax.lax.bitcast_convert_type(x, jnp.float32)
        elif name in UINT32_FIELDS:
            x = jax.lax.bitcast_convert_type(x, jnp.uint32)
        elif name in BOOL_FIELDS:
            x = x != 0
        out[name] = x
    return out


# ----- what a call returns for its rows ------------------------------------------------------
def news_width(decoder: BatchDecoder) -> tuple[int, int]:
    """(W, P): tokens and passes a row can gain in one step, a first token and one decode
    call (each pass emits at most `pass_positions` tokens)."""
    return 1 + decoder.call_lookahead, decoder.steps_per_call


def news(state: DecodeState, rows, tokens_before, passes_before, width: int,
         passes: int) -> jax.Array:
    """[n, 3 + W + P] int32 of rows [n] of `state`: the tokens and passes each row gained
    since it held `tokens_before` and `passes_before` (by the call that returns this),
    done, then output[tokens_before : + W] and pass_lengths[passes_before : + P] (0 past
    the buffers' ends). A call's news are its own gains, so the host needs no cursor: it
    can queue the next call before it has read this one."""
    def window(buffer, start, size):
        cols = start[:, None] + jnp.arange(size)[None, :]
        return buffer.at[rows[:, None], cols].get(mode="fill", fill_value=0)

    take = lambda x: x.at[rows].get(mode="fill", fill_value=0)  # noqa: E731
    return jnp.concatenate([
        (take(state.num_generated) - tokens_before)[:, None],
        (take(state.num_passes) - passes_before)[:, None],
        take(state.done).astype(jnp.int32)[:, None], window(state.output, tokens_before, width),
        window(state.pass_lengths, passes_before, passes)], axis=1)


# ----- compilation ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ProgramTiming:
    """How one program was made ready: traced and lowered (Python, holding the GIL) then
    compiled by XLA, or read whole from the program store (`loaded`, nothing traced)."""
    name: str                # "prefill" or "decode"
    key: tuple               # its compile key (`prefill_key`, `decode_key`)
    traced: float            # seconds tracing and lowering
    compiled: float          # seconds in XLA's compiler (or reading the store)
    loaded: bool

    def describe(self) -> str:
        if self.name == "decode":
            _, rows, mode, width = self.key
            what = f"decode {rows} row{'s' * (rows != 1)}, {mode}" + (
                "" if width is None else f", width {width}")
        else:
            _, rows, chunk = self.key
            what = f"prefill {rows} row{'s' * (rows != 1)} x {chunk} tokens"
        how = ("read from the program store" if self.loaded else
               f"traced {self.traced:.1f}s, compiled {self.compiled:.1f}s")
        return f"{what}: {how}"


class CompiledSteps:
    """The compiled prefill and decode calls of one decoder, one executable per shape key
    (state shapes, rows, chunk, sampling mode), compiled ahead of time. `precompile` compiles
    many keys at once on a thread pool (XLA compiles without the GIL), so a server with
    many buckets starts in about the time of its longest compile, not of their sum.
    `params`: the decoder's weights as the flat tuple every call takes."""

    def __init__(self, decoder: BatchDecoder):
        leaves, treedef = jax.tree.flatten(decoder.params())
        self.params = tuple(leaves)
        fns = {"prefill": functools.partial(prefill_rows, decoder, treedef),
               "decode": functools.partial(decode_rows, decoder, treedef)}
        self._jit = {"prefill": jax.jit(fns["prefill"], donate_argnames=("state",),
                                        static_argnames=("mode",)),
                     "decode": jax.jit(fns["decode"], donate_argnames=("state",),
                                       static_argnames=("mode", "width"))}
        self._executables: dict = {}
        # (name, key) -> the Future of a program compiling in the background (`compile_later`)
        self._pending: dict[tuple, concurrent.futures.Future] = {}
        self._background: list[concurrent.futures.ThreadPoolExecutor] = []
        self.switches = decoder.switches
        self.compiles = 0            # programs made ready so far (a timed call must see none)
        self.loaded = 0              # of which read from the program store, not compiled
        self._decoder = decoder
        self._identity: dict | None = None    # decoder.program_identity(), when first needed
        self._spans: list[tuple[float, float]] = []    # (start, end) of each compile
        self.timings: list[ProgramTiming] = []         # one per program made ready
        # called with each ProgramTiming as its program becomes ready (any thread)
        self.on_ready = None
        self._lock = threading.Lock()

    def __call__(self, name: str, key, *args, mode: str = "filtered", **static):
        """Run call `name` (compiled for `key` on first use); `static`: decode's width."""
        executable = self._executables.get((name, key))
        if executable is None:
            pending = self._pending.get((name, key))
            if pending is not None and not pending.cancelled():
                # compiling in the background: wait for it rather than compile it twice
                executable = self._executables[(name, key)] = pending.result()
            else:
                executable = self._executables[(name, key)] = self._compile(
                    name, key, args, mode, static)
        return executable(*args)

    def compiled(self, name: str, key) -> bool:
        """Whether call `name`'s program for `key` is ready to run."""
        return (name, key) in self._executables

    def pending(self, name: str, key) -> bool:
        """Whether call `name`'s program for `key` is compiling in the background."""
        return (name, key) in self._pending

    @property
    def compiling(self) -> int:
        """Programs still compiling in the background."""
        return len(self._pending)

    def _compile(self, name: str, key, args, mode: str, static: dict):
        """The executable of call `name` for `args` (compile key `key`): from the program
        store where it holds it (nothing traced), else traced, compiled and stored."""
        started = time.perf_counter()
        store = compile_cache.program_store()
        executable = stored = None
        if store is not None:
            if self._identity is None:
                self._identity = self._decoder.program_identity()
            stored = store.key(self._identity, name, args, {"mode": mode, **static})
            executable = store.load(stored)
        loaded = executable is not None
        traced = started
        if not loaded:
            with self.switches.active():     # in this thread: a compile worker's too
                lowered = self._jit[name].lower(*args, mode=mode, **static)
                traced = time.perf_counter()
                executable, fresh = program_store.compile_fresh(lowered)
            if store is not None and fresh:
                store.save(stored, executable)
        ended = time.perf_counter()
        timing = ProgramTiming(name, key, traced - started, ended - traced, loaded)
        with self._lock:
            self.compiles += 1
            self.loaded += loaded
            self._spans.append((started, ended))
            self.timings.append(timing)
        if self.on_ready is not None:
            self.on_ready(timing)
        return executable

    def hlo_texts(self, name: str) -> list[str]:
        """XLA's optimised HLO of every compiled `name` call ("prefill" or "decode"), as
        text (what `profile_step` reads its op names, bytes and FLOPs from)."""
        with self._lock:
            programs = [e for (n, _), e in self._executables.items() if n == name]
        return [e.as_text() for e in programs]

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling so far (summed over compile threads)."""
        with self._lock:
            return sum(b - a for a, b in self._spans)

    def compiling_within(self, start: float, end: float) -> float:
        """Seconds of [start, end] (perf_counter times) during which a program was being
        traced or compiled: Python's share of it holds the GIL, so a host loop timed over
        that window leaves it out."""
        with self._lock:
            spans = sorted((max(a, start), min(b, end)) for a, b in self._spans
                           if b > start and a < end)
        total, reach = 0.0, start
        for a, b in spans:       # overlapping compiles (threads) count once
            if b > reach:
                total += b - max(a, reach)
                reach = b
        return total

    def precompile(self, calls: list[tuple[str, object, tuple, str, dict]],
                   workers: int | None = None) -> None:
        """calls: (name, key, example args, sampling mode, static arguments); keys already
        compiled are skipped."""
        todo = {(n, k): (a, g, s) for n, k, a, g, s in calls if (n, k) not in self._executables}
        if not todo:
            return
        workers = workers or min(len(todo), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = {key: pool.submit(self._compile, *key, *todo[key]) for key in todo}
            for key, future in futures.items():
                self._executables[key] = future.result()

    def compile_later(self, calls: list[tuple[str, object, tuple, str, dict]],
                      workers: int | None = None) -> concurrent.futures.Future:
        """`precompile` in background threads, in the order given, returning at once: each
        program runs from when it is ready (`compiled`), and a call that needs one still
        compiling waits for it rather than compiling it twice. The returned Future is done
        (with the seconds taken) once every program has compiled."""
        todo = [(n, k, a, g, s) for n, k, a, g, s in calls
                if (n, k) not in self._executables and (n, k) not in self._pending]
        done: concurrent.futures.Future = concurrent.futures.Future()
        if not todo:
            done.set_result(0.0)
            return done
        started, left = time.perf_counter(), [len(todo)]
        # one core fewer than the machine has: the engine serves meanwhile
        pool = concurrent.futures.ThreadPoolExecutor(
            workers or min(len(todo), max(1, (os.cpu_count() or 2) - 1)), "dspine-compile")
        self._background.append(pool)

        def finished(key, future):
            if not future.cancelled() and future.exception() is None:
                self._executables[key] = future.result()
            elif not future.cancelled():
                log.warning("compiling %s in the background failed (it compiles on first "
                            "use): %r", key[0], future.exception())
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
            if last:        # its callbacks run before `compiling` reads 0
                done.set_result(time.perf_counter() - started)
            with self._lock:
                self._pending.pop(key, None)

        with self._lock:    # pending before a fast compile's callback can clear it
            futures = [((name, key), pool.submit(self._compile, name, key, args, mode, static))
                       for name, key, args, mode, static in todo]
            self._pending.update(futures)
        for key, future in futures:
            future.add_done_callback(functools.partial(finished, key))
        pool.shutdown(wait=False)       # its threads end with the last program
        return done

    def cancel_background(self) -> None:
        """Drop the background programs that have not started compiling (those compiling
        finish)."""
        for pool in self._background:
            pool.shutdown(wait=False, cancel_futures=True)
        self._background.clear()


def prefill_key(shapes: tuple, rows: int, chunk: int) -> tuple:
    """The compile key of a prefill call: the state's shapes (slots, pages, output
    buffer), its rows G and chunk T."""
    return (shapes, rows, chunk)


def decode_key(shapes: tuple, rows: int, mode: str, width: int | None) -> tuple:
    """The compile key of a decode call: the state's shapes, its rows R, sampling mode
    and verify width."""
    return (shapes, rows, mode, width)


def compiled(decoder: BatchDecoder) -> CompiledSteps:
    """The decoder's compiled calls (shared by every EngineCore over it), kept on the
    decoder so that they go with it: the calls hold the decoder, so a table keyed by it
    (even a weak one) would keep every decoder and its executables alive."""
    steps = getattr(decoder, "_slot_steps", None)
    if steps is None:
        steps = decoder._slot_steps = CompiledSteps(decoder)
    return steps


def empty_state(decoder: BatchDecoder, page_table, num_pages: int, out_len: int) -> DecodeState:
    """S idle slots over one pool of num_pages pages; page_table [S, PPS] (all out of range
    while no slot holds pages)."""
    return decoder.empty_state(decoder.create_caches(page_table, num_pages), out_len)


# ----- the calls -----------------------------------------------------------------------------
def prefill_rows(decoder: BatchDecoder, treedef, params, state: DecodeState, page_table,
                 rows, *, mode: str = "filtered") -> tuple[DecodeState, jax.Array]:
    """rows [G, F + T]: PREFILL_FIELDS, then the chunk's tokens (q_len real ones) to write
    after what each slot holds (nothing yet on a request's first chunk); then start
    start_slot (S where a row's prompt is not complete yet, or padding). Padding rows aim
    at slot S: they read an out-of-range page table row and write nothing. Returns the
    state and the started rows' news [G, 3 + W + P]. Prefill traces the general sampler
    ("filtered") for every group (argmax rows stay argmax): one token per row costs
    little, and it keeps one prefill variant per shape to compile."""
    params = jax.tree.unflatten(treedef, params)
    a = unpack_rows(rows, PREFILL_FIELDS)
    tokens, slots = rows[:, len(PREFILL_FIELDS):], a["slot"]
    caches = decoder.with_page_table(state.caches, page_table)
    pick = lambda x, fill: x.at[slots].get(mode="fill", fill_value=fill)  # noqa: E731
    # the G rows' view of the shared pools: [G, PPS] page tables, [G] lengths
    views = tuple(c.replace(page_table=pick(c.page_table, c.num_pages),
                            lengths=jnp.where(a["first_chunk"], 0, pick(c.lengths, 0)))
                  for c in caches)
    logits, views = decoder.prefill(params, tokens, a["q_len"], views)
    caches = tuple(c.replace(k_pages=r.k_pages, v_pages=r.v_pages,
                             lengths=c.lengths.at[slots].set(r.lengths, mode="drop"))
                   for c, r in zip(caches, views))
    # a served request samples as row 0 of an offline batch with its seed
    seeds = a["seed"]
    keys = request_keys(seeds, jnp.zeros_like(seeds))
    sampling = params_for_mode(a["temperature"], a["top_p"], a["top_k"], mode)
    state = decoder.start(state.replace(caches=caches), a["start_slot"], logits, sampling,
                          a["budget"], keys, a["ignore_eos"], a["resume_token"],
                          a["resume_count"])
    # `read`, set on starting rows only (0 elsewhere): the tokens a row held before its
    # first (a preempted one's: all it emitted)
    return state, news(state, a["start_slot"], a["read"], jnp.zeros_like(a["read"]),
                       *news_width(decoder))


def decode_rows(decoder: BatchDecoder, treedef, params, state: DecodeState, page_table,
                rows, passes, *, mode: str = "filtered",
                width: int | None = None) -> tuple[DecodeState, jax.Array]:
    """Up to `passes` target passes (a traced scalar, at most the decoder's
    steps_per_call: one program serves every call length), each verifying `width` drafts
    (None: the decoder's widest), over the R slots that are decoding (rows [R, F]:
    DECODE_FIELDS; padding: slot S); the other slots are not computed. The R rows' own
    fields are gathered into a state of R rows over the same page pools and scattered back
    after the call, so a step costs what R rows cost, and R, a power of two, compiles a
    handful of shapes. Returns the state and the rows' news [R, 3 + W + P]."""
    params = jax.tree.unflatten(treedef, params)
    a = unpack_rows(rows, DECODE_FIELDS)
    slots = a["slot"]
    caches = decoder.with_page_table(state.caches, page_table)
    num_slots = state.done.shape[0]
    real = slots < num_slots
    take = jnp.minimum(slots, num_slots - 1)

    def gather(x):
        return jnp.take(x, take, axis=0)

    # padding rows are done, read no page and write none (out-of-range page ids)
    views = tuple(c.replace(page_table=jnp.where(real[:, None], gather(c.page_table),
                                                 c.num_pages),
                            lengths=jnp.where(real, gather(c.lengths), 0)) for c in caches)
    sub = state.replace(
        caches=views, last_token=gather(state.last_token), output=gather(state.output),
        num_generated=gather(state.num_generated), done=gather(state.done) | ~real,
        budget=gather(state.budget), pass_lengths=gather(state.pass_lengths),
        num_passes=gather(state.num_passes), rng=gather(state.rng))
    sampling = params_for_mode(a["temperature"], a["top_p"], a["top_k"], mode)
    tokens_before, passes_before = sub.num_generated, sub.num_passes
    passes = jnp.minimum(passes, decoder.steps_per_call)    # the news hold no more
    sub = decoder.decode(params, sub, sampling, a["ignore_eos"], passes, width)

    def scatter(full, part):
        return full.at[slots].set(part, mode="drop")

    caches = tuple(c.replace(k_pages=r.k_pages, v_pages=r.v_pages,
                             lengths=scatter(c.lengths, r.lengths))
                   for c, r in zip(caches, sub.caches))
    state = state.replace(
        caches=caches, last_token=scatter(state.last_token, sub.last_token),
        output=scatter(state.output, sub.output),
        num_generated=scatter(state.num_generated, sub.num_generated),
        done=scatter(state.done, sub.done), budget=scatter(state.budget, sub.budget),
        pass_lengths=scatter(state.pass_lengths, sub.pass_lengths),
        num_passes=scatter(state.num_passes, sub.num_passes),
        rng=scatter(state.rng, sub.rng))
    mine = jnp.arange(slots.shape[0])
    return state, news(sub, mine, tokens_before, passes_before, *news_width(decoder))
