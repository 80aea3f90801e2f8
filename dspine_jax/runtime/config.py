"""What a decoder runs with, in one frozen record: the method, the weights' dtype, the
attention backend it resolved to, passes per host call, the KV page size, the proposal
path and kernel and the speculation settings of a drafter, and the kernel switches. It is
read off a built decoder (`RuntimeConfig.of`), so it says what runs rather than what was
asked for ("auto" resolved where the decoder resolves it), and it is what
`dspine generate --json` ("runtime") and `/health` print.
"""

from __future__ import annotations

import dataclasses

import numpy as np


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
                   switches=decoder.switches.to_json())

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
