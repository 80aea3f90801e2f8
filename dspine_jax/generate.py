"""Autoregressive generation with the target alone: batched, ragged, compiled per bucket.

Prefill and decode are jitted once per shape bucket (prompt length and budget rounded up
to powers of two) and compiled ahead of time, so `seconds` never includes compilation.
Decoding runs `steps_per_call` tokens per host round trip in a device-side loop; the host
only streams the new tokens between calls.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dspine_jax.errors import InputError
from dspine_jax.kv_cache import KVCache
from dspine_jax.sampling import SamplingParams, sample_tokens
from dspine_jax.target import TargetModel

MIN_BUCKET = 16


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Round up to a power of two so a handful of shapes cover every request."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


@struct.dataclass
class DecodeState:
    cache: KVCache
    last_token: jax.Array     # [B] the token emitted last (next step's input)
    output: jax.Array         # [B, N] emitted tokens
    num_generated: jax.Array  # [B]
    done: jax.Array           # [B] bool
    budget: jax.Array         # [B] max new tokens per row
    rng: jax.Array


@dataclasses.dataclass
class Generation:
    tokens: list[int]          # generated ids only (EOS included when it ended the row)
    prompt_tokens: int
    finish_reason: str         # "stop" (EOS) or "length"
    seconds: float             # prefill + decode wall time, compilation excluded


@dataclasses.dataclass
class PreparedBatch:
    prefill: Callable[[], DecodeState]
    decode: Callable[[DecodeState], DecodeState]  # steps_per_call tokens per call
    compile_seconds: float


@dataclasses.dataclass
class BatchResult:
    generations: list[Generation]
    seconds: float
    compile_seconds: float


class AutoregressiveGenerator:
    def __init__(self, model: TargetModel, *, eos_token_ids: Sequence[int] = (),
                 steps_per_call: int = 8):
        self.config = model.config
        self.cache_dtype = model.dtype
        self.graphdef, self.params = nnx.split(model)
        self.eos = jnp.asarray(list(eos_token_ids) or [-1], jnp.int32)
        self.steps_per_call = steps_per_call
        self._compiled: dict[tuple, Callable] = {}

    # ----- compiled pieces -------------------------------------------------------------
    def _prefill_fn(self, params, tokens, prompt_lengths, cache, sampling, budget, rng,
                    ignore_eos, out_len):
        model = nnx.merge(self.graphdef, params)
        out = model(tokens, cache, logits_at=(prompt_lengths - 1)[:, None])
        rng, key = jax.random.split(rng)
        first = sample_tokens(out.logits[:, 0], sampling, key)
        b = tokens.shape[0]
        output = jnp.zeros((b, out_len), jnp.int32).at[:, 0].set(first)
        return DecodeState(cache=out.cache.replace(lengths=prompt_lengths), last_token=first,
                           output=output, num_generated=jnp.ones((b,), jnp.int32),
                           done=self._finished(first, jnp.ones((b,), jnp.int32), budget,
                                               ignore_eos),
                           budget=budget, rng=rng)

    def _decode_fn(self, params, state: DecodeState, sampling, ignore_eos, num_steps):
        model = nnx.merge(self.graphdef, params)

        def step(carry):
            i, s = carry
            out = model(s.last_token[:, None], s.cache)
            rng, key = jax.random.split(s.rng)
            token = sample_tokens(out.logits[:, 0], sampling, key)
            active = ~s.done
            rows = jnp.arange(token.shape[0])
            # Finished rows write out of range (dropped) and keep their cache length.
            slot = jnp.where(active, s.num_generated, s.output.shape[1])
            output = s.output.at[rows, slot].set(token, mode="drop")
            num = s.num_generated + active
            done = s.done | (self._finished(token, num, s.budget, ignore_eos) & active)
            lengths = jnp.where(active, out.cache.lengths, s.cache.lengths)
            return i + 1, s.replace(cache=out.cache.replace(lengths=lengths),
                                    last_token=jnp.where(active, token, s.last_token),
                                    output=output, num_generated=num, done=done, rng=rng)

        _, state = jax.lax.while_loop(lambda c: (c[0] < num_steps) & ~jnp.all(c[1].done), step,
                                      (jnp.int32(0), state))
        return state

    def _finished(self, token, num_generated, budget, ignore_eos=False):
        is_eos = jnp.any(token[:, None] == self.eos[None, :], axis=-1) & ~ignore_eos
        return is_eos | (num_generated >= budget)

    def _compile(self, key, fn, *args, static=(), donate=()):
        if key not in self._compiled:
            jitted = jax.jit(fn, static_argnames=static, donate_argnames=donate)
            self._compiled[key] = jitted.lower(*args).compile()
        return self._compiled[key]

    # ----- public API ------------------------------------------------------------------
    def check_request(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        if not prompts:
            raise InputError("no prompts given")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        context = self.config.max_position_embeddings
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise InputError(f"prompt {i} is empty after tokenization")
            if len(p) + max_new_tokens > context:
                raise InputError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it "
                    f"needs {len(p) + max_new_tokens} positions, past the model's context of "
                    f"{context}. Shorten the prompt or lower max_new_tokens.")
            bad = [t for t in p if not 0 <= t < self.config.vocab_size]
            if bad:
                raise InputError(f"prompt {i} has token ids outside the vocabulary "
                                 f"[0, {self.config.vocab_size}): {bad[:5]}")

    def prepare(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
                temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                seed: int = 0, ignore_eos: bool = False) -> "PreparedBatch":
        """Check the request, pad it into its shape bucket and compile (once per bucket).

        Returns the two stages as closures so callers (and benchmarks) can drive them."""
        self.check_request(prompts, max_new_tokens)
        b = len(prompts)
        sampling = SamplingParams.create(b, temperature, top_p, top_k)
        longest = max(len(p) for p in prompts)
        prompt_len = bucket(longest)
        out_len = bucket(max_new_tokens)
        capacity = min(bucket(longest + max_new_tokens), self.config.max_position_embeddings)
        tokens = np.zeros((b, prompt_len), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
        budget = jnp.full((b,), max_new_tokens, jnp.int32)
        rng = jax.random.key(seed)
        ignore = jnp.asarray(ignore_eos)

        def args():  # a fresh cache per call: prefill donates it
            cache = KVCache.create(self.config, b, capacity, self.cache_dtype)
            return (self.params, tokens, lengths, cache, sampling, budget, rng, ignore)

        t0 = time.perf_counter()
        prefill = self._compile(("prefill", b, prompt_len, capacity, out_len),
                                self._prefill_fn, *args(), out_len, static=("out_len",),
                                donate=("cache",))
        state = jax.eval_shape(functools.partial(self._prefill_fn, out_len=out_len), *args())
        decode = self._compile(("decode", b, capacity, out_len), self._decode_fn, self.params,
                               state, sampling, ignore, self.steps_per_call,
                               static=("num_steps",), donate=("state",))
        return PreparedBatch(prefill=lambda: prefill(*args()),
                             decode=lambda s: decode(self.params, s, sampling, ignore),
                             compile_seconds=time.perf_counter() - t0)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int = 0, ignore_eos: bool = False,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> BatchResult:
        """Generate for a batch of token-id prompts. `on_tokens(row, new_ids)` streams."""
        run = self.prepare(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                           top_p=top_p, top_k=top_k, seed=seed, ignore_eos=ignore_eos)
        b = len(prompts)
        t0 = time.perf_counter()
        state = run.prefill()
        emitted = [0] * b
        while True:
            num, done, output = jax.device_get((state.num_generated, state.done, state.output))
            if on_tokens is not None:
                for row in range(b):
                    if num[row] > emitted[row]:
                        on_tokens(row, output[row, emitted[row]:num[row]].tolist())
            emitted = num.tolist()
            if done.all():
                break
            state = run.decode(state)
        seconds = time.perf_counter() - t0
        compile_seconds = run.compile_seconds

        eos = set(np.asarray(self.eos).tolist())
        generations = []
        for row in range(b):
            ids = output[row, :num[row]].tolist()
            reason = "stop" if ids and ids[-1] in eos and not ignore_eos else "length"
            generations.append(Generation(tokens=ids, prompt_tokens=len(prompts[row]),
                                          finish_reason=reason, seconds=seconds))
        return BatchResult(generations=generations, seconds=seconds,
                           compile_seconds=compile_seconds)
