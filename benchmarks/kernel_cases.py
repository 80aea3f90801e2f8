"""What `torch_kernels.py` (Triton and PyTorch) and `jax_kernels.py` (JAX and Pallas) share,
so that their rows of one op compare: the shapes, the bytes each op must move at least,
the run plan and the --quick budget. Plain Python: neither side's framework is imported.

Shape fields: d hidden, v vocab, r transfer rank, m message size, k block size, c
candidates per slot; n = batch * (k - 1) drafted slots.
"""

from __future__ import annotations

import time

SHAPES = {"qwen3-8b": {"d": 4096, "v": 151936, "r": 512, "m": 256, "k": 16, "c": 16},
          "smollm2-135m": {"d": 576, "v": 49152, "r": 512, "m": 256, "k": 16, "c": 16},
          "tiny": {"d": 64, "v": 512, "r": 16, "m": 8, "k": 5, "c": 4}}
QUICK_BUDGET_S = 50.0


def op_bytes(op: str, shape: dict, batch: int) -> int:
    """The bytes an op must read and write at least (bf16 weights and states, float32
    scores and logits, int64 ids as on the PyTorch side):
      vocab_topk  the lm_head, the slots' states, C (value, id) pairs per slot
      transition  per slot: C lm_head rows, its state, C messages and the C x C scores;
                  the write matrix once
      chain_walk  one row of C scores per slot, and the candidates read and tokens written
      injection   the layer's readout, gates, message and write, and the states in and out
      acceptance  the target's float32 logits [B, K, V]"""
    d, v, r, m, k, c = (shape[x] for x in "dvrmkc")
    n = batch * (k - 1)
    if op == "vocab_topk":
        return v * d * 2 + n * d * 2 + n * c * 12
    if op == "transition":
        return n * (c * d * 2 + d * 2 + c * m * 4 + c * c * 4) + d * m * 2
    if op == "chain_walk":
        return n * c * 4 + n * c * 8 * 2
    if op == "injection":
        return 2 * (r * d + 3 * m * r + d * m) + 2 * batch * k * d * 2
    if op == "acceptance":
        return batch * k * v * 4
    raise ValueError(f"unknown op {op!r}")


def plan(args, cpu: bool) -> tuple[list[str], list[int], int, int]:
    """(shapes, batches, iters, repeats) from the parsed options: --quick is the SmolLM2
    shape (the tiny one on the CPU), 10 calls, at most 3 repeats; the CPU runs the tiny
    shape once at batch 1 (its timings mean nothing)."""
    shapes, iters, repeats = args.shapes, args.iters, args.repeats
    if args.quick:
        shapes = shapes or ("tiny" if cpu else "smollm2-135m")
        iters, repeats = iters or 10, min(repeats, 3)
    shapes = shapes.split(",") if shapes else (["tiny"] if cpu else ["qwen3-8b", "smollm2-135m"])
    batches = [int(b) for b in (args.batches.split(",") if args.batches else
                                (["1"] if cpu else ["1", "8"]))]
    return shapes, batches, iters or (2 if cpu else 50), 1 if cpu else repeats


class QuickBudget:
    """--quick's time limit: `spent(what)` says (and prints) that `what` is skipped."""

    def __init__(self, quick: bool):
        self.quick, self.start = quick, time.perf_counter()

    def spent(self, what: str) -> bool:
        if self.quick and time.perf_counter() - self.start > QUICK_BUDGET_S:
            print(f"skipped (--quick budget of {QUICK_BUDGET_S:.0f} s spent): {what}")
            return True
        return False
