"""Offline generation: a list of token-id prompts through the engine core, no HTTP.

`stream_tokens` and `generate_tokens` are how every offline front end decodes
(`Pipeline.generate` and `stream`, `dspine generate`, `dspine eval`, `dspine parity`,
`data regenerate`): one engine, the serving engine's core, with `max_slots` slots of
continuous batching. A response that ends frees its slot for the next prompt at once;
with at least as many slots as prompts every prompt is admitted at once and nothing is
refilled, which is a static batch. With a drafter the slots pay even when every row
decodes the same number of tokens: each row advances by its own accepted length per
pass, so a static batch of 8 runs as many passes as its slowest row.

Each slot can hold the longest prompt plus `max_new_tokens` (plus the verify block), so
nothing is preempted. On an accelerator the programs a run will likely take compile in
parallel before it starts; on the CPU they compile on first use, only the shapes a run
takes. `seconds` leaves the compilation out. Every decode call runs the decoder's most passes
(`steps_per_call`); only `dspine serve` shortens them while rows share a call.

With a seed S, prompt i samples from S + i, as a served request with that seed does: a
sampled response depends on its seed alone, not on the slot count or the prompts beside
it, and its calls verify the whole block (a seed reproduces a sample at one width only).
Without one every prompt draws a fresh seed, and adaptive speculation picks each call's
width for sampled rows as it does for greedy ones. At T = 0 every response is the
target's greedy one, seeded or not.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Iterator, Sequence

import jax

from dspine_jax.decoding import BatchDecoder, BatchResult, Generation, bucket
from dspine_jax.errors import InputError
from dspine_jax.runtime import rows
from dspine_jax.runtime.engine_core import (DEFAULT_PREFILL_CHUNK, EngineConfig, EngineCore,
                                            SamplingOptions)
from dspine_jax.sampling import batch_sampling_mode


def core_for(decoder: BatchDecoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             max_slots: int | None = None) -> EngineCore:
    """An engine core sized for these prompts: every slot holds the longest prompt plus
    `max_new_tokens` and the verify block (rounded up to a power of two, so runs of
    similar sizes share their programs), and a prefill chunk no longer than the longest
    prompt needs. max_slots: at most this many rows decode at once (default: all)."""
    if not prompts:
        raise InputError("no prompts given")
    if max_slots is None:
        max_slots = len(prompts)
    if not isinstance(max_slots, int) or isinstance(max_slots, bool) or max_slots < 1:
        raise InputError(f"the slot count (batch size) must be a positive integer, "
                         f"got {max_slots!r}")
    if (not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool)
            or max_new_tokens < 1):
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    longest = max(len(p) for p in prompts)
    context = decoder.config.max_position_embeddings
    max_model_len = min(bucket(longest + max_new_tokens + decoder.extra_capacity), context)
    chunk = rows.bucket_up(min(max(longest, 1), DEFAULT_PREFILL_CHUNK),
                           rows.row_buckets(DEFAULT_PREFILL_CHUNK, minimum=16))
    return EngineCore(decoder, EngineConfig(
        max_slots=min(max_slots, len(prompts)), max_model_len=max_model_len,
        prefill_chunk=chunk))


def stream_tokens(decoder: BatchDecoder, prompts: Sequence[Sequence[int]], *,
                  max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                  top_k: int = 0, seed: int | None = None, ignore_eos: bool = False,
                  max_slots: int | None = None) -> Iterator[tuple[int, list[int]]]:
    """Yield (prompt index, new token ids) as they arrive; the generator returns the
    BatchResult (generations in the order of the prompts). seed: prompt i samples from
    seed + i (reproducible); None: fresh seeds. Every prompt is checked before anything
    compiles."""
    core = core_for(decoder, prompts, max_new_tokens, max_slots)
    try:
        options = [SamplingOptions(max_tokens=max_new_tokens, temperature=temperature,
                                   top_p=top_p, top_k=top_k,
                                   seed=None if seed is None else seed + i,
                                   ignore_eos=ignore_eos) for i in range(len(prompts))]
        for i, (prompt, option) in enumerate(zip(prompts, options)):
            try:
                core.check_request(prompt, option)
            except InputError as e:
                raise InputError(f"prompt {i}: {e}") from None
        if jax.default_backend() != "cpu":
            _compile_ahead(core, prompts, options[0])
        return (yield from _decode(core, prompts, options))
    finally:
        core.close()


def _compile_ahead(core: EngineCore, prompts, options: SamplingOptions) -> None:
    """Compile the programs the run will most likely reach, in parallel (XLA compiles
    without the GIL): the decode calls of every row bucket up to the first wave's (rows
    finish one by one), and the prefill calls of the first wave and of each later
    admission. A program missed here compiles on first use. Not on the CPU, where the
    compile threads would take the cores the run needs and compiling on first use
    leaves out the shapes a run never takes."""
    s = core.scheduler
    first = min(core.max_slots, len(prompts))
    chunk = lambda n: rows.bucket_up(min(n, s.prefill_chunk), s.chunk_sizes)  # noqa: E731
    prefills = {(rows.bucket_up(first, s.row_sizes),
                 chunk(max(len(p) for p in prompts[:first])))}
    later = prompts[first:]
    prefills |= {(s.row_sizes[0], chunk(len(p))) for p in later}
    if later:       # rows that finish together are refilled together
        prefills.add((rows.bucket_up(min(first, len(later)), s.row_sizes),
                      chunk(max(len(p) for p in later))))
    if max(len(p) for p in prompts) > s.prefill_chunk:     # long prompts: full chunks too
        prefills |= {(g, s.prefill_chunk) for g, _ in list(prefills)}
    with core.decoder.switches.active():
        mode = batch_sampling_mode([options.temperature], [options.top_p], [options.top_k])
    decode_rows = [r for r in s.row_sizes if r <= rows.bucket_up(first, s.row_sizes)]
    core.compile_ahead(decode_rows, [mode], sorted(prefills))


def _decode(core: EngineCore, prompts, options) -> Iterator[tuple[int, list[int]]]:
    tokens = [[] for _ in prompts]
    accepts = [[] for _ in prompts]
    widths = [collections.Counter() for _ in prompts]
    reasons: list[str | None] = [None] * len(prompts)
    compiled_before = core.compile_seconds
    started = time.perf_counter()
    first_read = None
    for i, (prompt, option) in enumerate(zip(prompts, options)):
        core.add_request(str(i), prompt, option)
    steps = 0
    while core.has_work():
        for out in core.step():
            i = int(out.request_id)
            if first_read is None:
                first_read = time.perf_counter()
            if out.accept_lengths:
                widths[i][out.verify_width] += len(out.accept_lengths)
            accepts[i] += out.accept_lengths
            reasons[i] = out.finish_reason
            if out.new_token_ids:
                tokens[i] += out.new_token_ids
                yield i, out.new_token_ids
        steps += 1
    ended = time.perf_counter()
    compile_seconds = core.compile_seconds - compiled_before
    # compilation (on first use) is left out of both times
    seconds = ended - started - core.compiling_within(started, ended)
    first_read = first_read or started
    prefill = first_read - started - core.compiling_within(started, first_read)
    core.decoder.finished_batch()
    generations = [Generation(tokens=t, prompt_tokens=len(p), finish_reason=r,
                              accept_lengths=a, verify_widths=dict(sorted(w.items())))
                   for t, a, r, p, w in zip(tokens, accepts, reasons, prompts, widths)]
    return BatchResult(generations=generations, seconds=seconds,
                       compile_seconds=compile_seconds,
                       prefill_seconds=prefill, steps=steps,
                       preemptions=core.preemptions, engine=core.config.to_json())


def generate_tokens(decoder: BatchDecoder, prompts: Sequence[Sequence[int]], *,
                    on_tokens: Callable[[int, list[int]], None] | None = None,
                    **options) -> BatchResult:
    """Decode token-id prompts; `on_tokens(prompt index, new ids)` streams. Options:
    those of `stream_tokens`."""
    events = stream_tokens(decoder, prompts, **options)
    while True:
        try:
            i, ids = next(events)
        except StopIteration as finished:
            return finished.value
        if on_tokens is not None:
            on_tokens(i, ids)
