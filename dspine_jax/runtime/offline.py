"""Offline generation with continuous batching: the serving engine's core, no HTTP.

`generate(pipe, prompts, slots=B)` (a `Pipeline.generate` with continuous batching) and
`dspine generate --engine slots` decode a list of prompts through B slots: a response
that ends frees its slot for the next prompt at once, where static batches
(`Pipeline.generate`) run until their longest row is done. With a drafter that matters
even when every row decodes the same number of tokens: each row advances by its own
accepted length per pass, so a static batch of 8 runs as many passes as its slowest row,
and the slots keep every row busy instead.

Every call shape is compiled before the clock starts (`EngineCore.warmup`, only the
sampling mode the settings need), so `seconds` is decoding alone, as for the batch
engine. Each prompt draws from its own seed (`seed + its index`): a sampled response
does not depend on the slot count or on the prompts decoded beside it. At T = 0 the
tokens equal the batch engine's (both are the target's greedy output).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from dspine_jax.api import Pipeline, Prompt, Result, as_prompts
from dspine_jax.decoding import BatchDecoder
from dspine_jax.errors import InputError
from dspine_jax.sampling import batch_sampling_mode, validate_sampling
from dspine_jax.runtime import slot_steps
from dspine_jax.runtime.engine_core import DEFAULT_PREFILL_CHUNK, EngineCore, SamplingOptions


@dataclasses.dataclass
class SlotGeneration:
    tokens: list[int]            # EOS included when it ended the response
    accept_lengths: list[int]    # tokens emitted by each target pass (1 per AR step)
    finish_reason: str           # stop or length
    prompt_tokens: int


@dataclasses.dataclass
class SlotRun:
    generations: list[SlotGeneration]   # in the order of the prompts
    seconds: float                      # first admission to the last response, all prompts
    compile_seconds: float
    steps: int                          # engine steps (each: a prefill and/or a decode call)
    preemptions: int


def core_for(decoder: BatchDecoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             max_slots: int) -> EngineCore:
    """An engine core sized for these prompts: every slot can hold the longest prompt
    plus `max_new_tokens` (plus the verify block), so nothing is ever preempted, and a
    prefill chunk no longer than the longest prompt needs (fewer shapes to compile)."""
    if not isinstance(max_slots, int) or max_slots < 1:
        raise InputError(f"the slot count (batch size) must be a positive integer, "
                         f"got {max_slots!r}")
    decoder.check_request(prompts, max_new_tokens)   # empty, too long, outside the vocab
    longest = max(len(p) for p in prompts)
    chunk = slot_steps.bucket_up(min(longest, DEFAULT_PREFILL_CHUNK),
                                 slot_steps.row_buckets(DEFAULT_PREFILL_CHUNK, minimum=16))
    return EngineCore(decoder, max_slots=min(max_slots, len(prompts)),
                      max_model_len=longest + max_new_tokens + decoder.extra_capacity,
                      prefill_chunk=chunk)


def generate_slots(decoder: BatchDecoder, prompts: Sequence[Sequence[int]], *,
                   max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                   top_k: int = 0, seed: int = 0, ignore_eos: bool = False,
                   max_slots: int = 8) -> SlotRun:
    """Decode `prompts` (token ids) through `max_slots` slots; prompt i samples from
    seed + i. Every prompt is checked before anything compiles."""
    core = core_for(decoder, prompts, max_new_tokens, max_slots)
    options = [SamplingOptions(max_tokens=max_new_tokens, temperature=temperature,
                               top_p=top_p, top_k=top_k, seed=seed + i,
                               ignore_eos=ignore_eos) for i in range(len(prompts))]
    for i, (prompt, option) in enumerate(zip(prompts, options)):
        try:
            core.check_request(prompt, option)
        except InputError as e:
            raise InputError(f"prompt {i}: {e}") from None
    with decoder.switches.active():
        mode = batch_sampling_mode(np.float32([temperature]), np.float32([top_p]),
                                   np.int32([top_k]))
    compile_seconds = core.warmup(modes=[mode])

    tokens = [[] for _ in prompts]
    accepts = [[] for _ in prompts]
    reasons: list[str | None] = [None] * len(prompts)
    started = time.perf_counter()
    for i, (prompt, option) in enumerate(zip(prompts, options)):
        core.add_request(str(i), prompt, option)
    steps = 0
    while core.has_work():
        for out in core.step():
            i = int(out.request_id)
            tokens[i] += out.new_token_ids
            accepts[i] += out.accept_lengths
            if out.finished:
                reasons[i] = out.finish_reason
        steps += 1
    seconds = time.perf_counter() - started
    generations = [SlotGeneration(t, a, r, len(p))
                   for t, a, r, p in zip(tokens, accepts, reasons, prompts)]
    return SlotRun(generations, seconds, compile_seconds, steps, core.preemptions)


def generate(pipe: Pipeline, prompts: Sequence[Prompt | str], *, chat: bool | None = None,
             max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int = 0, ignore_eos: bool = False,
             slots: int = 8) -> list[Result]:
    """`Pipeline.generate` through `slots` slots of continuous batching; results keep the
    input order. Prompt i samples from seed + i; `seconds` is the whole run's."""
    validate_sampling(temperature, top_p, top_k)
    prompts = as_prompts(prompts, chat)
    run = generate_slots(pipe.decoder, [pipe.encode(p) for p in prompts],
                         max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                         top_k=top_k, seed=seed, ignore_eos=ignore_eos, max_slots=slots)
    return [Result(text=pipe.tokenizer.decode(g.tokens), tokens=g.tokens,
                   prompt_tokens=g.prompt_tokens, finish_reason=g.finish_reason,
                   accept_lengths=g.accept_lengths, seconds=run.seconds,
                   compile_seconds=run.compile_seconds, batch_size=slots)
            for g in run.generations]
