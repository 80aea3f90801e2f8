"""A fixed batch driven call by call: the engine's own compiled calls with no scheduler.

For what times one pass or one call, not a whole request: the step benchmarks
(`spec_step`, `profile_step`, `decode_step`), the speculation cost table
(`speculative.costs`) and tests that run a chosen width by hand. B prompts take the B
slots of one state, every row holds the pages of its whole request from the start (the
pool is exactly their sum), the prefill is one chunk, and each `decode` is one decode call
over every row (`steps_per_call` passes). The programs are `slot_steps`', keyed as an
`EngineCore` of the same shape keys them, so both share them.

    batch = FixedBatch(decoder, prompts, max_new_tokens=64, ignore_eos=True)
    state = batch.prefill()                 # a fresh state every time (donated below)
    state = batch.decode(state, width=3)    # one call; compiles width 3 on first use
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspine_jax.decoding import BatchDecoder, DecodeState, bucket
from dspine_jax.errors import InputError
from dspine_jax.page_pool import pages_needed
from dspine_jax.runtime import rows as row_fields
from dspine_jax.runtime import slot_steps
from dspine_jax.runtime.slots import SlotPages
from dspine_jax.sampling import batch_sampling_mode


class FixedBatch:
    def __init__(self, decoder: BatchDecoder, prompts: Sequence[Sequence[int]], *,
                 max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, ignore_eos: bool = False):
        """Prompt i samples from seed + i (as in `offline.stream_tokens`)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InputError("a fixed batch needs prompts, none of them empty")
        self.decoder = decoder
        b = len(prompts)
        longest = max(len(p) for p in prompts)
        need = [len(p) + max_new_tokens + decoder.extra_capacity for p in prompts]
        context = decoder.config.max_position_embeddings
        if max(need) > context:
            raise InputError(f"a prompt of {longest} tokens and max_new_tokens="
                             f"{max_new_tokens} need {max(need)} positions, past the model's "
                             f"context of {context}")
        max_model_len = min(bucket(max(need)), context)
        num_pages = sum(pages_needed(n, decoder.page_size) for n in need)
        pages = SlotPages(b, num_pages, decoder.page_size, max_model_len)
        for n in need:
            pages.take(n)
        self._table = jnp.asarray(pages.table)
        self._steps = slot_steps.compiled(decoder)
        shapes = (b, num_pages, max_model_len)
        t = bucket(longest)
        self._prefill_key = slot_steps.prefill_key(shapes, b, t)
        self._empty = jax.jit(lambda: slot_steps.empty_state(decoder, self._table, num_pages,
                                                             max_model_len))
        fields = len(row_fields.PREFILL_FIELDS)
        prefill = np.zeros((b, fields + t), np.int32)
        for i, p in enumerate(prompts):
            prefill[i, :fields] = row_fields.pad_row(
                row_fields.PREFILL_FIELDS, b, slot=i, q_len=len(p), first_chunk=True,
                start_slot=i, budget=max_new_tokens, seed=(seed + i) % 2 ** 32,
                temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos)
            prefill[i, fields:fields + len(p)] = p
        self._prefill_rows = jnp.asarray(prefill)
        self._decode_rows = jnp.asarray(np.stack([row_fields.pad_row(
            row_fields.DECODE_FIELDS, b, slot=i, temperature=temperature, top_p=top_p,
            top_k=top_k, ignore_eos=ignore_eos) for i in range(b)]))
        with decoder.switches.active():
            self._mode = batch_sampling_mode(np.float32([temperature]), np.float32([top_p]),
                                             np.int32([top_k]))
        self._shapes = shapes
        self._passes = jnp.int32(decoder.steps_per_call)
        jax.block_until_ready(self.decode(self.prefill()))     # both programs, run once

    def prefill(self) -> DecodeState:
        """A fresh state with every prompt prefilled and its first token emitted."""
        state, _ = self._steps("prefill", self._prefill_key, self._steps.params,
                               self._empty(), self._table, self._prefill_rows)
        return state

    def decode(self, state: DecodeState, width: int | None = None) -> DecodeState:
        """One decode call over every row (the state is donated), verifying `width` drafts
        per pass (None: the decoder's default)."""
        width = self.decoder.default_width() if width is None else width
        key = slot_steps.decode_key(self._shapes, len(self._decode_rows), self._mode, width)
        state, _ = self._steps("decode", key, self._steps.params, state, self._table,
                               self._decode_rows, self._passes, mode=self._mode, width=width)
        return state
