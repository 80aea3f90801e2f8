"""The per-row arguments of the engine's calls, packed as one int32 matrix per call.

A call's rows travel as one host-to-device copy instead of one per argument: each row is
its fields (floats as their bits), then, for a prefill, the chunk's tokens. Calls are
padded to a few sizes (`row_buckets`). Imports no JAX: the scheduler packs the rows, and
`slot_steps.unpack_rows` reads them on the device.

Shape legend: F fields of a row, S slots (a padding row aims at slot S).
"""

from __future__ import annotations

import math

import numpy as np

# The per-row fields of each call, the columns of its int32 row matrix.
DECODE_FIELDS = ("slot", "temperature", "top_p", "top_k", "ignore_eos")
PREFILL_FIELDS = ("slot", "q_len", "first_chunk", "start_slot", "budget", "seed",
                  "temperature", "top_p", "top_k", "ignore_eos", "resume_token",
                  "resume_count", "read")
FLOAT32_FIELDS = ("temperature", "top_p")
UINT32_FIELDS = ("seed",)
BOOL_FIELDS = ("ignore_eos", "first_chunk")


def row_buckets(limit: int, minimum: int = 1, *, doubling_from: int | None = None) -> list[int]:
    """Sizes a call is padded to: powers of 4 from `minimum`, then from `doubling_from` on
    powers of 2 (and `limit` itself). Each size is one more program to compile; a call
    padded to four times its rows costs little while it is bound by launches or weight
    reads (one row to four), but not at tens of rows (SmolLM2 on an H100, context 256: an
    AR step 1.46 ms at 32 rows, 1.73 ms at 64; a DSpine pass, a block verified per row,
    2.78 and 3.92 ms)."""
    doubling_from = math.inf if doubling_from is None else doubling_from
    sizes, n = [], minimum
    while n < limit:
        sizes.append(n)
        n = n * 2 if n >= doubling_from else min(n * 4, doubling_from)
    return sizes + [limit]


def bucket_up(n: int, sizes: list[int]) -> int:
    return next(s for s in sizes if s >= n)


def field_bits(name: str, value) -> int:
    """A field's value as the int32 the row matrix holds."""
    if name in FLOAT32_FIELDS:
        return int(np.float32(value).view(np.int32))
    if name in UINT32_FIELDS:
        return int(np.uint32(value).view(np.int32))
    return int(value)


def pad_row(fields: tuple[str, ...], num_slots: int, **values) -> np.ndarray:
    """[F] int32: a padding row (aimed at slot S, greedy, no resume), with `values`."""
    defaults = dict(slot=num_slots, start_slot=num_slots, budget=1, top_p=1.0,
                    resume_token=-1)
    merged = {**defaults, **values}
    return np.array([field_bits(f, merged.get(f, 0)) for f in fields], np.int32)


def column(matrix: np.ndarray, fields: tuple[str, ...], name: str) -> np.ndarray:
    """One field of every row of a row matrix, in the field's own dtype."""
    x = matrix[:, fields.index(name)]
    if name in FLOAT32_FIELDS:
        return x.view(np.float32)
    if name in UINT32_FIELDS:
        return x.view(np.uint32)
    return x
