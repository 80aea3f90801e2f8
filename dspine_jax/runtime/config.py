"""What an engine runs with, in two frozen records.

`RuntimeConfig`: the decoder's choices (the method, the weights' dtype, the attention
backend it resolved to, passes per host call, the KV page size, the proposal path and
kernel and the speculation settings of a drafter, the kernel switches and the target
layers' kernels). It is read off a built decoder (`RuntimeConfig.of`), so it says what
runs rather than what was asked for ("auto" resolved where the decoder resolves it).

`EngineConfig`: the engine's (slots, the longest request, the page pool, the prefill
chunk, the waiting queue, the verify widths compiled). It is checked when it is made; the
engine core keeps the resolved copy (defaults filled in).

Both are what `dspine generate --json` ("runtime", "engine") and `/health` print, and
every compiled program's shape follows from them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dspine_jax.errors import InputError

DEFAULT_PREFILL_CHUNK = 512


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    method: str                      # ar, dflash or dspine
    dtype: str                       # the weights' (bfloat16, float32)
    attention_backend: str           # xla or pallas (resolved)
    steps_per_call: int              # target passes per device call (at most)
    shared_steps_per_call: int       # the slot engine's while several rows decode
    page_size: int                   # KV cache positions per page
    proposal: str | None = None      # sparse or dense; None for AR
    proposal_kernel: str | None = None
    speculation: dict | None = None  # SpeculationConfig.to_json() and the compiled widths
    switches: dict = dataclasses.field(default_factory=dict)
    layer_kernels: str = "xla"       # the target's decode layers: xla or fused

    @classmethod
    def of(cls, decoder) -> "RuntimeConfig":
        """The record of a built decoder (AR or speculative)."""
        speculative = getattr(decoder, "speculation", None)
        method = decoder.drafter_config.kind if speculative is not None else "ar"
        return cls(method=method, dtype=np.dtype(decoder.dtype).name,
                   attention_backend=decoder.attention.name,
                   steps_per_call=decoder.steps_per_call,
                   shared_steps_per_call=decoder.shared_steps_per_call,
                   page_size=decoder.page_size,
                   proposal=getattr(decoder, "proposal_impl", None),
                   proposal_kernel=getattr(decoder, "proposal_kernel", None),
                   speculation=({**speculative.to_json(), "widths": list(decoder.widths)}
                                if speculative is not None else None),
                   switches=decoder.switches.to_json(),
                   layer_kernels="xla" if decoder.layer_kernels is None else "fused")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _positive(name: str, value, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise InputError(f"{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's choices. None: the default the engine resolves (max_model_len: the
    model's context; num_pages: a full max_model_len for every slot; max_waiting: no
    limit; verify_widths: adaptive speculation's whole set)."""
    max_slots: int = 8                        # requests decoded together (rows)
    max_model_len: int | None = None          # prompt + output positions per request
    num_pages: int | None = None              # KV pages the slots share
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK    # prompt tokens per request and step
    max_waiting: int | None = None            # requests queued for a slot, at most
    verify_widths: tuple[int, ...] | None = None  # widths adaptive speculation picks from

    def __post_init__(self):
        _positive("max_slots", self.max_slots)
        _positive("max_model_len", self.max_model_len, optional=True)
        _positive("num_pages", self.num_pages, optional=True)
        _positive("prefill_chunk", self.prefill_chunk)
        if self.max_waiting is not None and (not isinstance(self.max_waiting, int)
                                             or self.max_waiting < 0):
            raise InputError(f"max_waiting must be a non-negative integer, "
                             f"got {self.max_waiting!r}")
        if self.verify_widths is not None:
            widths = tuple(sorted({int(w) for w in self.verify_widths}))
            if not widths or widths[0] < 0:
                raise InputError(f"verify_widths must be non-negative integers, "
                                 f"got {self.verify_widths!r}")
            object.__setattr__(self, "verify_widths", widths)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
