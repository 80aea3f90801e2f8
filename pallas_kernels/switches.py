"""Switches that change what a compiled decoding program computes: kernel variants and
search strategies, each exact, kept for before/after measurements.

One frozen record, `Switches`. A decoder takes its record when it is built
(`Switches.from_environment()` reads the DSPINE_* variables below once, there) and traces
every program inside `Switches.active`, so the functions deep in a trace read the
decoder's record (`current()`) and never the environment: a program is compiled under
the switches of the decoder that owns it, and changing a variable later changes nothing
until a new decoder is built. Outside any decoder, `current()` is the defaults.

  field              variable                 values (default first)
  warp_unfiltered    DSPINE_WARP_UNFILTERED   1 | 0   sampled batches without top-p/top-k
                                                      skip the vocabulary threshold
  warp_threshold     DSPINE_WARP_THRESHOLD    pallas | sort | search   how the GPU
                                                      warp finds its top-p/top-k
                                                      threshold: the sort-free search in
                                                      a Pallas kernel, a sort of each
                                                      row, or the search in XLA
  chain_walk         DSPINE_CHAIN_WALK        auto | all | steps   how a sampled DSpine
                                                      chain is walked
  top_k_grouped      DSPINE_TOP_K_GROUPED     1 | 0   the grouped top-k on GPUs
  top_k_split        DSPINE_TOP_K_SPLIT       1 | 0   the split top-k on GPUs
  top_k_select       DSPINE_TOP_K_SELECT      sort | topk   the grouped top-k's two
                                                      selections: a sort of each row, or
                                                      XLA's TopK
  rpa_fused_write    DSPINE_RPA_FUSED_WRITE   1 | 0   the attention kernel writes the new
                                                      tokens into the pages itself
  rpa_combine        DSPINE_RPA_COMBINE       unrolled | xla | kernel   how the
                                                      attention kernel's split partials
                                                      are merged
  rpa_packed         DSPINE_RPA_PACKED        1 | 0   the GPU attention kernel reads q, k
                                                      and v from the layer's one packed
                                                      operand (0: split first)
  rpa_rope           DSPINE_RPA_ROPE          0 | 1   1: the GPU attention kernel rotates
                                                      q and the new keys as it loads them
                                                      (0: the fusion that packs them
                                                      does; 1 is slower on an H100)
  verify_gemm        DSPINE_VERIFY_GEMM       xla | pallas   a projection of 16 to 256
                                                      rows on a CUDA GPU (a verify's):
                                                      XLA's GEMM or split_k_matmul
                                                      (level at batch 1, slower at 8 on
                                                      an H100)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from typing import Iterator, Mapping

CHAIN_WALKS = ("auto", "all", "steps")
COMBINES = ("unrolled", "xla", "kernel")
TOP_K_SELECTS = ("sort", "topk")
WARP_THRESHOLDS = ("pallas", "sort", "search")
VERIFY_GEMMS = ("xla", "pallas")
FLAGS = {"warp_unfiltered": ("DSPINE_WARP_UNFILTERED", True),
         "top_k_grouped": ("DSPINE_TOP_K_GROUPED", True),
         "top_k_split": ("DSPINE_TOP_K_SPLIT", True),
         "rpa_fused_write": ("DSPINE_RPA_FUSED_WRITE", True),
         "rpa_packed": ("DSPINE_RPA_PACKED", True),
         "rpa_rope": ("DSPINE_RPA_ROPE", False)}
CHOICES = {"warp_threshold": ("DSPINE_WARP_THRESHOLD", WARP_THRESHOLDS),
           "chain_walk": ("DSPINE_CHAIN_WALK", CHAIN_WALKS),
           "rpa_combine": ("DSPINE_RPA_COMBINE", COMBINES),
           "top_k_select": ("DSPINE_TOP_K_SELECT", TOP_K_SELECTS),
           "verify_gemm": ("DSPINE_VERIFY_GEMM", VERIFY_GEMMS)}


@dataclasses.dataclass(frozen=True)
class Switches:
    warp_unfiltered: bool = True
    warp_threshold: str = "pallas"
    chain_walk: str = "auto"
    top_k_grouped: bool = True
    top_k_split: bool = True
    top_k_select: str = "sort"
    rpa_fused_write: bool = True
    rpa_combine: str = "unrolled"
    rpa_packed: bool = True
    rpa_rope: bool = False
    verify_gemm: str = "xla"

    def __post_init__(self):
        for name, (variable, allowed) in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} ({variable}) must be one of {', '.join(allowed)}, "
                                 f"got {getattr(self, name)!r}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> "Switches":
        """The record the DSPINE_* variables set (read here, once); unset ones default."""
        environ = os.environ if environ is None else environ
        values = {}
        for name, (variable, default) in FLAGS.items():
            raw = environ.get(variable)
            if raw is not None:
                if raw not in ("0", "1"):
                    raise ValueError(f"{variable} must be 0 or 1, got {raw!r}")
                values[name] = raw == "1"
        for name, (variable, _) in CHOICES.items():
            if variable in environ:
                values[name] = environ[variable]
        return cls(**values)

    @contextlib.contextmanager
    def active(self) -> Iterator["Switches"]:
        """Trace with these switches: `current()` returns them inside."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


_CURRENT: contextvars.ContextVar[Switches] = contextvars.ContextVar(
    "dspine_switches", default=Switches())


def current() -> Switches:
    """The switches of the program being traced (the defaults outside any decoder)."""
    return _CURRENT.get()
