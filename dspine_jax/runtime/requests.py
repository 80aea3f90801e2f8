"""A request's options and what it gains per step: the engine's request types and the one
check of sampling settings every front end uses. Imports no JAX.
"""

from __future__ import annotations

import dataclasses
import math

from dspine_jax.errors import InputError

FINISH_REASONS = ("stop", "length", "abort")


class QueueFull(InputError):
    """The waiting queue is at its bound: the server answers 429."""


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """One request's decoding options (OpenAI names). `seed=None` draws a fresh seed."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()           # applied on text by the server, not here
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        validate_sampling(self.temperature, self.top_p, self.top_k)
        if (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                or self.max_tokens < 1):
            raise InputError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and not (isinstance(self.seed, int)
                                          and 0 <= self.seed < 2 ** 63):
            raise InputError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")


def validate_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """One check of the sampling settings, for every front end."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and temperature >= 0):
        raise InputError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise InputError(f"top_p must be in (0, 1], got {top_p!r}")
    if not (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 0):
        raise InputError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")


@dataclasses.dataclass
class RequestOutput:
    """What one request gained in one step (or in one call of it: `EngineCore.step`)."""
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None        # stop (EOS or a stop token), length, abort
    accept_lengths: list[int]        # tokens emitted by each new target pass (1 for AR)
    prompt_tokens: int
    completion_tokens: int           # all tokens so far, EOS / stop token included
    verify_width: int = 0            # drafts each of those passes verified (0: AR step)


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request from a step's calls, in order of first appearance: a
    request whose prompt a step's prefill completes gains its first token there and more
    in the same step's decode call."""
    merged: dict[str, RequestOutput] = {}
    for o in outputs:
        prev = merged.get(o.request_id)
        merged[o.request_id] = o if prev is None else dataclasses.replace(
            o, new_token_ids=prev.new_token_ids + o.new_token_ids,
            accept_lengths=prev.accept_lengths + o.accept_lengths)
    return list(merged.values())
