"""The engine core's compiled calls over its slots: one `DecodeState` of S rows whose
caches (target KV, drafter context) share one page pool, driven through the decoder's
public step API (`prefill`, `start`, `decode`).

  prefill_rows   one prefill chunk for G slots; slots whose prompt is then complete start
                 decoding (first token sampled, or a preempted request's anchor taken back)
  decode_rows    one decode call (steps_per_call target passes) over the R decoding
                 slots, gathered into R rows (a power-of-two bucket) and scattered back
  release_rows   slots stop: done, cache lengths 0 (their pages go back to the pool)

The page table lives on the host (`slots.SlotPages`) and comes with every call, so a row's
growth, preemption or release never recompiles anything. Compiled functions live with their
decoder, not with one EngineCore: a server restarted in-process (or several cores over one
pipeline) compiles nothing twice. Calls are padded to a few sizes (`row_buckets`: R and G
in powers of 4, T from 16 in powers of 4 up to the prefill chunk), each compiled ahead of
time per (size, `SamplingParams.all_greedy`) key, all of them at start-up in parallel.

Shape legend: S slots, R decoding rows in a decode call (bucketed), G rows in a prefill
call, T prefill chunk, PPS pages per slot, V vocab.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import weakref

import jax
import jax.numpy as jnp

from dspine_jax.decoding import BatchDecoder, DecodeState, request_keys

_COMPILED: "weakref.WeakKeyDictionary[BatchDecoder, CompiledSteps]" = (
    weakref.WeakKeyDictionary())


def row_buckets(limit: int, minimum: int = 1) -> list[int]:
    """Sizes a call is padded to: powers of 4 from `minimum` (and `limit` itself). Four
    times as many rows costs a decode step little (it is bound by weight reads or launches:
    1.13 ms at batch 1 and 1.19 ms at batch 8 for SmolLM2 on an H200), and each size is
    one more program to compile at start-up."""
    sizes, n = [], minimum
    while n < limit:
        sizes.append(n)
        n *= 4
    return sizes + [limit]


def bucket_up(n: int, sizes: list[int]) -> int:
    return next(s for s in sizes if s >= n)


class CompiledSteps:
    """The compiled prefill / decode / release calls of one decoder, one executable per
    shape key (state shapes, rows, chunk, greedy), compiled ahead of time. `precompile`
    compiles many keys at once on a thread pool (XLA compiles without the GIL), so a server
    with many buckets starts in about the time of its longest compile, not of their sum."""

    def __init__(self, decoder: BatchDecoder):
        fns = {"prefill": functools.partial(prefill_rows, decoder),
               "decode": functools.partial(decode_rows, decoder), "release": release_rows}
        self._jit = {name: jax.jit(fn, donate_argnames=("state",)) for name, fn in fns.items()}
        self._executables: dict = {}

    def __call__(self, name: str, key, *args):
        executable = self._executables.get((name, key))
        if executable is None:
            executable = self._executables[(name, key)] = self._compile(name, args)
        return executable(*args)

    def _compile(self, name: str, args):
        return self._jit[name].lower(*args).compile()

    def precompile(self, calls: list[tuple[str, object, tuple]],
                   workers: int | None = None) -> None:
        """calls: (name, key, example args); keys already compiled are skipped."""
        todo = {(n, k): a for n, k, a in calls if (n, k) not in self._executables}
        if not todo:
            return
        workers = workers or min(len(todo), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = {key: pool.submit(self._compile, key[0], args)
                       for key, args in todo.items()}
            for key, future in futures.items():
                self._executables[key] = future.result()


def compiled(decoder: BatchDecoder) -> CompiledSteps:
    """The decoder's compiled calls (shared by every EngineCore over it)."""
    if decoder not in _COMPILED:
        _COMPILED[decoder] = CompiledSteps(decoder)
    return _COMPILED[decoder]


def empty_state(decoder: BatchDecoder, page_table, num_pages: int, out_len: int) -> DecodeState:
    """S idle slots over one pool of num_pages pages; page_table [S, PPS] (all out of range
    while no slot holds pages)."""
    return decoder.empty_state(decoder.create_caches(page_table, num_pages), out_len)


def prefill_rows(decoder: BatchDecoder, params, state: DecodeState, page_table, slots, tokens,
                 q_lens, start_slots, sampling, budget, seeds, ignore_eos, resume_token,
                 resume_count) -> DecodeState:
    """Write tokens [G, T] (q_lens [G] real ones) after what slots [G] hold, then start
    start_slots [G] (S where a row's prompt is not complete yet, or padding). Padding
    rows aim at slot S: they read an out-of-range page table row and write nothing."""
    caches = decoder.with_page_table(state.caches, page_table)
    pick = lambda x, fill: x.at[slots].get(mode="fill", fill_value=fill)  # noqa: E731
    # the G rows' view of the shared pools: [G, PPS] page tables, [G] lengths
    rows = tuple(c.replace(page_table=pick(c.page_table, c.num_pages),
                           lengths=pick(c.lengths, 0)) for c in caches)
    logits, rows = decoder.prefill(params, tokens, q_lens, rows)
    caches = tuple(c.replace(k_pages=r.k_pages, v_pages=r.v_pages,
                             lengths=c.lengths.at[slots].set(r.lengths, mode="drop"))
                   for c, r in zip(caches, rows))
    # a served request samples as row 0 of an offline batch with its seed
    keys = request_keys(seeds, jnp.zeros_like(seeds))
    return decoder.start(state.replace(caches=caches), start_slots, logits, sampling, budget,
                         keys, ignore_eos, resume_token, resume_count)


def decode_rows(decoder: BatchDecoder, params, state: DecodeState, page_table, slots,
                sampling, ignore_eos) -> DecodeState:
    """steps_per_call target passes over the R slots [R] that are decoding (padding: S);
    the other slots are not computed. The R rows' own fields are gathered into a state of
    R rows over the same page pools and scattered back after the call, so a step costs
    what R rows cost, and R, a power of two, compiles a handful of shapes."""
    caches = decoder.with_page_table(state.caches, page_table)
    num_slots = state.done.shape[0]
    real = slots < num_slots
    take = jnp.minimum(slots, num_slots - 1)

    def gather(x):
        return jnp.take(x, take, axis=0)

    # padding rows are done, read no page and write none (out-of-range page ids)
    rows = tuple(c.replace(page_table=jnp.where(real[:, None], gather(c.page_table),
                                                c.num_pages),
                           lengths=jnp.where(real, gather(c.lengths), 0)) for c in caches)
    sub = state.replace(
        caches=rows, last_token=gather(state.last_token), output=gather(state.output),
        num_generated=gather(state.num_generated), done=gather(state.done) | ~real,
        budget=gather(state.budget), pass_lengths=gather(state.pass_lengths),
        num_passes=gather(state.num_passes), rng=gather(state.rng))
    sub = decoder.decode(params, sub, sampling, ignore_eos, decoder.steps_per_call)

    def scatter(full, part):
        return full.at[slots].set(part, mode="drop")

    caches = tuple(c.replace(k_pages=r.k_pages, v_pages=r.v_pages,
                             lengths=scatter(c.lengths, r.lengths))
                   for c, r in zip(caches, sub.caches))
    return state.replace(
        caches=caches, last_token=scatter(state.last_token, sub.last_token),
        output=scatter(state.output, sub.output),
        num_generated=scatter(state.num_generated, sub.num_generated),
        done=scatter(state.done, sub.done), budget=scatter(state.budget, sub.budget),
        pass_lengths=scatter(state.pass_lengths, sub.pass_lengths),
        num_passes=scatter(state.num_passes, sub.num_passes),
        rng=scatter(state.rng, sub.rng))


def release_rows(state: DecodeState, slots) -> DecodeState:
    """slots [S] (S: padding) stop: done, and their caches empty for the next request."""
    caches = tuple(c.replace(lengths=c.lengths.at[slots].set(0, mode="drop"))
                   for c in state.caches)
    return state.replace(done=state.done.at[slots].set(True, mode="drop"), caches=caches)
