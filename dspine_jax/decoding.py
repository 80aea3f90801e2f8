"""What every decoder shares: the device-side step loop, token emission (EOS, budget)
and the step API the engine core drives (`dspine_jax.runtime`).

A decoder defines three things: the caches it needs, a `prefill` that writes a chunk of
tokens into them and returns the logits after each row's last one, and one `step` (one
target pass) that proposes tokens for `emit`. Around them sits the step API:

  prefill(params, tokens, q_lens, caches)   a chunk [B, T] after what the caches hold
  start(state, rows, logits, ...)           rows begin decoding: the first token sampled
                                            from the prefill's logits, or a preempted
                                            request's last token taken back as the anchor
  decode(params, state, sampling, ...)      up to `num_steps` steps in a `lax.while_loop`
  call_lookahead                            cache positions one decode call can write

Randomness is per row: `DecodeState.rng` holds one key per row, and a row's step draws
from its key folded with its token count (`step_keys`), so its samples depend on its own
seed and progress only, never on its neighbours, its row index or a preemption.

Caches are paged: every model's cache shares one page table, and the engine core's slots
share one page pool. Attention runs on the decoder's `attention` backend.

Shape legend: B batch, T prefill chunk, G rows started, N output buffer, E tokens a step
may emit, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dspine_jax import row_keys
from dspine_jax.attention import AttentionBackend, select_backend
from dspine_jax.errors import InputError
from dspine_jax.fused_layers import FusedLayers, select_layer_kernels
from dspine_jax.page_pool import DEFAULT_PAGE_SIZE
from dspine_jax.sampling import sample_tokens
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
class BatchResult:
    generations: list[Generation]
    seconds: float             # prefill + decode wall time, compilation excluded
    compile_seconds: float
    prefill_seconds: float = 0.0  # of `seconds`: until the first tokens are read
    steps: int = 0                # engine steps (each: a prefill and/or a decode call)
    preemptions: int = 0
    engine: dict = dataclasses.field(default_factory=dict)  # the EngineConfig it ran on


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
                 page_size: int = DEFAULT_PAGE_SIZE,
                 switches: Switches | None = None,
                 layer_kernels: str | FusedLayers = "xla"):
        """attention_backend: "auto" (pallas where the platform compiles it, else xla),
        "pallas", "xla" or an AttentionBackend. switches: the kernel and search variants
        every program of this decoder is traced with (default: the DSPINE_* variables,
        read now; `pallas_kernels.switches`). steps_per_call: target passes per decode
        call (at most); shared_steps_per_call: the engine's passes per call while several
        rows decode or requests wait (default and at most steps_per_call).
        layer_kernels: "xla", or "fused" (the target's layers of decode steps and
        verification passes through Pallas kernels, `dspine_jax.fused_layers`; CUDA GPUs)
        or a FusedLayers."""
        for name, value in (("steps_per_call", steps_per_call),
                            ("shared_steps_per_call", shared_steps_per_call)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        self.switches = switches or Switches.from_environment()
        self.config = target.config
        self.dtype = target.dtype
        self.page_size = page_size
        self.attention = select_backend(attention_backend, self.attention_configs(target),
                                        dtype=target.dtype, page_size=page_size)
        self.layer_kernels = select_layer_kernels(layer_kernels, target.config)
        target.fuse_projections()    # in place: one GEMM for q/k/v and one for gate/up
        self.target_graph, self.target_params = nnx.split(target)
        self.eos = jnp.asarray(list(eos_token_ids) or [-1], jnp.int32)
        self.steps_per_call = steps_per_call
        self.shared_steps_per_call = min(shared_steps_per_call or steps_per_call,
                                         steps_per_call)

    def program_identity(self) -> dict:
        """Everything besides the code and the argument shapes that a traced program of
        this decoder depends on (`program_store`): its runtime choices, the models'
        configs, the attention backend and the EOS ids (the one array a program closes
        over; the weights are arguments)."""
        from dspine_jax.runtime.config import RuntimeConfig

        return {"decoder": type(self).__qualname__,
                "runtime": RuntimeConfig.of(self).to_json(), "target": repr(self.config),
                "drafter": repr(getattr(self, "drafter_config", None)),
                "attention": repr(self.attention), "eos": np.asarray(self.eos).tolist()}

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

    def default_width(self) -> int | None:
        """The width a call runs when none is asked for (None: the decoder has one)."""
        return None

    def speculation_policy(self):
        """The `SpeculationPolicy` choosing verify widths, or None (one width only)."""
        return None

    def finished_batch(self) -> None:
        """A batch's stream ended (the speculative engine saves what its policy measured)."""
