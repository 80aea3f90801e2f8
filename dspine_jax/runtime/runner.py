"""The engine's device side: the state of S slots, the compiled calls, and the thread
that runs them.

The scheduler plans each call as an int32 row matrix (`scheduler.Call`); the runner
uploads it (one host-to-device copy, and the page table only when it changed), runs the
call's program (compiled once per shape key: slots, pages, rows, chunk, sampling mode,
verify width; `slot_steps`) on the device state, and returns the future of its news,
what each row gained in the call, for the engine to read back in one transfer.

The calls run in a thread of their own: on a GPU a call's multi-pass loop holds the
thread that launched it until its last pass is launched (the loop's exit test is read on
the host every pass), so the engine plans and reads in its own thread meanwhile (the
call releases the GIL). Only the runner thread touches the device state once serving
has begun.

A third thread times the device: it waits for each call's news in launch order and
records how long the device was busy with it (from its launch, or the end of the call
before it if that was later, to its end). The engine thread reads news whenever its
host work allows; the time between its reads counts that host work too, and taught
adaptive speculation costs up to 2.5x the device's.

Shape legend: S slots, R rows of a decode call, G rows of a prefill call, T prefill chunk.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspine_jax.decoding import BatchDecoder
from dspine_jax.runtime import rows as row_fields
from dspine_jax.runtime import slot_steps
from dspine_jax.runtime.scheduler import MEASURING_PASSES, Call
from dspine_jax.runtime.slots import SlotPages
from dspine_jax.sampling import batch_sampling_mode


# The sampling modes whose programs can run a decode call's rows, its own first: greedy
# rows take the argmax in any program, and the filtered sampler draws unfiltered rows
# from the whole distribution.
MODE_COVERS = {"greedy": ("greedy", "unfiltered", "filtered"),
               "unfiltered": ("unfiltered", "filtered"), "filtered": ("filtered",)}


class Runner:
    def __init__(self, decoder: BatchDecoder, pages: SlotPages, max_model_len: int, *,
                 row_sizes: Sequence[int] = (), chunk_sizes: Sequence[int] = (),
                 widest: int | None = None):
        """row_sizes, chunk_sizes: the buckets calls are padded to, and widest the widest
        verify width: what `cover` may run a call on while its own program compiles."""
        self.decoder = decoder
        self._row_sizes, self._chunk_sizes, self._widest = row_sizes, chunk_sizes, widest
        self.covering = False    # cover every call whose program is not compiled
        self.steps = slot_steps.compiled(decoder)
        self._params = self.steps.params
        # what shapes the state: a key of every compiled call (runners share a decoder's)
        self.shapes = (pages.num_slots, pages.num_pages, max_model_len)
        self._pages = pages
        self._table = (-1, None)     # (SlotPages.version, the page table on the device)
        self._state = slot_steps.empty_state(decoder, pages.table, pages.num_pages,
                                             out_len=max_model_len)
        # a decode call's pass count, by value: uploaded once, not per call
        self._passes = {n: jnp.int32(n) for n in
                        {decoder.steps_per_call, decoder.shared_steps_per_call, 1,
                         min(MEASURING_PASSES, decoder.shared_steps_per_call)}}
        self._ran: set[tuple] = set()    # (name, key) of every program run so far
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "dspine-runner")
        self._timer = concurrent.futures.ThreadPoolExecutor(1, "dspine-device-timer")
        self._device_free = 0.0     # when the device finished the last timed call
        # device seconds by call ("prefill", "decode"), and idle: between a call's end and
        # the launch of the next one queued while a step was in flight (`Call.pipelined`),
        # the device waiting for the host (the timer thread adds them)
        self.device_seconds = {"prefill": 0.0, "decode": 0.0, "idle": 0.0}

    def sampling_mode(self, rows: np.ndarray) -> str:
        """What a decode call's rows ask of the sampler (part of its key): all greedy (no
        sampling is traced), sampled without top-k/top-p (no vocabulary threshold), or
        filtered."""
        fields = row_fields.DECODE_FIELDS
        with self.decoder.switches.active():
            return batch_sampling_mode(row_fields.column(rows, fields, "temperature"),
                                       row_fields.column(rows, fields, "top_p"),
                                       row_fields.column(rows, fields, "top_k"))

    def submit(self, call: Call) -> concurrent.futures.Future:
        """Queue a call on the runner thread (`cover`ed first); returns the future of its
        news [rows, ...] (a device array, read later by `read`)."""
        self.cover(call)
        name, matrix, static = self._program(call)
        inputs = (self._passes[call.passes],) if call.decode else ()
        key = self._key(call, static)
        call.first_run = (name, key) not in self._ran
        self._ran.add((name, key))
        return self._thread.submit(self._run, call, name, key, self._page_table(),
                                   jnp.asarray(matrix), inputs, static)

    def read(self, futures: Sequence[concurrent.futures.Future]) -> list[np.ndarray]:
        """The news of queued calls, in one device-to-host transfer."""
        return jax.device_get([f.result() for f in futures])

    def cover(self, call: Call) -> None:
        """While the program of `call` compiles in the background (or is not compiled,
        while `covering`), run the call on a ready program that computes the same rows: a
        larger bucket of rows (padding rows) or of chunk (padding tokens), a more general
        sampling mode, or the widest verify width (adaptive speculation's width is a
        choice of speed; the accept rule is exact at every width). `call` is changed in
        place (rows, requests, mode, width), so what the engine records of it is what
        ran. Without a ready cover the call waits for its own program."""
        if not (self.steps.compiling or self.covering):
            return
        name, _, static = self._program(call)
        if call.decode:
            call.mode = static["mode"]      # read from the rows once: `submit` reuses it
        key = self._key(call, static)
        if self.steps.compiled(name, key) or not (self.covering or self.steps.pending(name,
                                                                                   key)):
            return
        rows = call.rows.shape[0]
        if call.decode:
            mode = static["mode"]
            for size, width, cover_mode in itertools.product(
                    [r for r in self._row_sizes if r >= rows],
                    dict.fromkeys((call.width, self._widest)), MODE_COVERS[mode]):
                key = slot_steps.decode_key(self.shapes, size, cover_mode, width)
                if self.steps.compiled("decode", key):
                    call.rows = self._pad_rows(call.rows, size, row_fields.DECODE_FIELDS)
                    call.mode, call.width = cover_mode, width
                    break
            else:
                return
        else:
            fields = len(row_fields.PREFILL_FIELDS)
            chunk = call.rows.shape[1] - fields
            for size, wider in itertools.product([r for r in self._row_sizes if r >= rows],
                                                 [t for t in self._chunk_sizes if t >= chunk]):
                if self.steps.compiled("prefill", slot_steps.prefill_key(self.shapes, size,
                                                                         wider)):
                    padded = np.zeros((rows, fields + wider), np.int32)  # padding tokens
                    padded[:, :call.rows.shape[1]] = call.rows
                    call.rows = self._pad_rows(padded, size, row_fields.PREFILL_FIELDS)
                    break
            else:
                return
        call.requests = call.requests + [None] * (call.rows.shape[0] - rows)

    def _pad_rows(self, matrix: np.ndarray, size: int, fields: tuple[str, ...]) -> np.ndarray:
        """[n, C] -> [size, C] with padding rows (aimed at slot S, no tokens)."""
        pad = np.zeros((size - matrix.shape[0], matrix.shape[1]), np.int32)
        pad[:, :len(fields)] = row_fields.pad_row(fields, self._pages.num_slots)
        return np.concatenate([matrix, pad])

    def precompile(self, calls: Sequence[Call], background: bool = False):
        """Compile each call's program (in parallel threads) without running it; with
        `background`, return at once the Future of their seconds
        (`CompiledSteps.compile_later`)."""
        todo = []
        for call in calls:
            name, matrix, static = self._program(call)
            inputs = (self._passes[1],) if call.decode else ()
            mode = static.pop("mode")
            todo.append((name, self._key(call, {**static, "mode": mode}),
                         (self._params, self._state, self._page_table(), jnp.asarray(matrix))
                         + inputs, mode, static))
        if background:
            return self.steps.compile_later(todo)
        self.steps.precompile(todo)

    def close(self) -> None:
        """Stop the runner thread once its queued calls are done, and the background
        compiles not yet started."""
        self.steps.cancel_background()
        self._thread.shutdown(wait=True)
        self._timer.shutdown(wait=True)

    # ----- inside ----------------------------------------------------------------------
    def _program(self, call: Call) -> tuple[str, np.ndarray, dict]:
        """(program name, row matrix, static arguments) of a call. Prefill traces the
        general sampler for every group (one token per row costs little, and it keeps one
        prefill variant per shape)."""
        if call.decode:
            mode = call.mode or self.sampling_mode(call.rows)
            return "decode", call.rows, {"mode": mode, "width": call.width}
        return "prefill", call.rows, {"mode": "filtered"}

    def _key(self, call: Call, static: dict) -> tuple:
        rows = call.rows.shape[0]
        if call.decode:
            return slot_steps.decode_key(self.shapes, rows, static["mode"], static["width"])
        chunk = call.rows.shape[1] - len(row_fields.PREFILL_FIELDS)
        return slot_steps.prefill_key(self.shapes, rows, chunk)

    def _page_table(self) -> jax.Array:
        """The page table on the device, uploaded again only when a row of it changed."""
        version, table = self._table
        if version != self._pages.version:   # a copy: the host table changes in place
            self._table = version, table = self._pages.version, jnp.array(self._pages.table)
        return table

    def _run(self, call: Call, name: str, key, page_table, matrix, inputs: tuple,
             static: dict) -> jax.Array:
        """In the runner thread: one call on the device state; its device time is
        measured in the timer thread (`call.device_seconds`)."""
        launched = time.perf_counter()
        self._state, news = self.steps(name, key, self._params, self._state, page_table,
                                       matrix, *inputs, **static)
        call.device_seconds = self._timer.submit(self._device_busy, news, launched, name,
                                                 call.pipelined)
        return news

    def _device_busy(self, news: jax.Array, launched: float, name: str,
                     pipelined: bool) -> float:
        """In the timer thread, call by call in launch order: seconds from when the device
        could start the call (its launch, or the previous call's end) to its end."""
        jax.block_until_ready(news)
        end = time.perf_counter()
        start = max(launched, self._device_free)
        if pipelined and self._device_free:
            self.device_seconds["idle"] += start - self._device_free
        busy, self._device_free = end - start, end
        self.device_seconds[name] += busy
        return busy
