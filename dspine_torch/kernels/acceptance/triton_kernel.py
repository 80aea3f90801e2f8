"""Triton kernels of the verification rule (see reference.py for the math).

  _row_stats   grid (B * K,): one pass over a row of the target's logits: its max, its
               first argmax, and sum exp(l / T - max) (an online softmax over V tiles).
  _accept      grid (B,): the kept prefix (T = 0: draft == argmax; T > 0: u q < p with
               p(d) from the row stats and q(d) looked up in sparse or dense q), then the
               next token: the argmax at T = 0; at T > 0 two passes over row n: the mass
               of the residual max(0, p - q) (sparse q subtracted by id compare inside each
               tile), then the inverse-CDF draw at u_next (from p if the residual is empty,
               from p_S, the bonus, when all S drafts were kept). Both passes recompute
               p and q tile by tile with `_tile_p_q`.

p over the vocabulary is never written to memory. With top-k or top-p the caller passes
warped logits (-inf outside the kept set) and temperature 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspine_torch.kernels.common import next_power_of_2


@triton.jit
def _row_stats(logits_ptr, max_ptr, arg_ptr, sum_ptr, inv_temp, V: tl.constexpr,
               BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_V)
    lane_best = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    lane_arg = tl.zeros((BLOCK_V,), tl.int32)
    lane_sum = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(logits_ptr + row * V + v0 + offs, mask=v0 + offs < V,
                    other=float("-inf")).to(tl.float32) * inv_temp
        better = x > lane_best
        new_best = tl.maximum(lane_best, x)
        finite = new_best > float("-inf")
        scale = tl.where(finite, tl.exp(lane_best - new_best), 0.0)
        lane_sum = lane_sum * scale + tl.where(finite, tl.exp(x - new_best), 0.0)
        lane_arg = tl.where(better, v0 + offs, lane_arg)
        lane_best = new_best
    best = tl.max(lane_best, 0)
    arg = tl.min(tl.where(lane_best == best, lane_arg, V), 0)
    total = tl.sum(tl.where(lane_best > float("-inf"), lane_sum * tl.exp(lane_best - best), 0.0),
                   0)
    tl.store(max_ptr + row, best)
    tl.store(arg_ptr + row, arg)
    tl.store(sum_ptr + row, total)


@triton.jit
def _tile_p_q(logits_ptr, qp_ptr, ids, probs, row, qrow, v, has_q, best, norm, inv_temp,
              V: tl.constexpr, SPARSE: tl.constexpr):
    """p over the vocabulary tile `v` of logits row `row` (from the row's max and
    normaliser), and q over it: sparse (ids, probs) compared by id, or dense row `qrow`
    (zero where `has_q` is false: the bonus row has no q)."""
    x = tl.load(logits_ptr + row * V + v, mask=v < V,
                other=float("-inf")).to(tl.float32) * inv_temp
    p = tl.where(x > float("-inf"), tl.exp(x - best), 0.0) / norm
    if SPARSE:
        q = tl.sum(tl.where(v[:, None] == ids[None, :], probs[None, :], 0.0), 1)
    else:
        q = tl.load(qp_ptr + qrow * V + v, mask=(v < V) & has_q, other=0.0)
    return p, q


@triton.jit
def _accept(logits_ptr, draft_ptr, qid_ptr, qp_ptr, max_ptr, arg_ptr, sum_ptr, ua_ptr,
            un_ptr, n_ptr, next_ptr, inv_temp, C, S: tl.constexpr, V: tl.constexpr,
            GREEDY: tl.constexpr, SPARSE: tl.constexpr, C_PAD: tl.constexpr,
            BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    K: tl.constexpr = S + 1
    pc = tl.arange(0, C_PAD)
    n = tl.program_id(0) * 0
    alive = n == 0
    for i in tl.static_range(S):
        d = tl.load(draft_ptr + b * S + i)
        if GREEDY:
            kept = d == tl.load(arg_ptr + b * K + i)
        else:
            l = tl.load(logits_ptr + (b * K + i) * V + d).to(tl.float32) * inv_temp
            p = tl.where(l > float("-inf"),
                         tl.exp(l - tl.load(max_ptr + b * K + i)), 0.0) / tl.load(
                             sum_ptr + b * K + i)
            if SPARSE:
                ids = tl.load(qid_ptr + (b * S + i) * C + pc, mask=pc < C, other=-1)
                probs = tl.load(qp_ptr + (b * S + i) * C + pc, mask=pc < C, other=0.0)
                q = tl.sum(tl.where(ids == d, probs, 0.0), 0)
            else:
                q = tl.load(qp_ptr + (b * S + i) * V + d)
            kept = tl.load(ua_ptr + b * S + i) * q < p
        alive = alive & kept
        n += alive.to(tl.int32)
    tl.store(n_ptr + b, n)
    row = b * K + n
    if GREEDY:
        tl.store(next_ptr + b, tl.load(arg_ptr + row))
    else:
        best = tl.load(max_ptr + row)
        norm = tl.load(sum_ptr + row)
        has_q = n < S
        qrow = b * S + tl.minimum(n, S - 1)
        offs = tl.arange(0, BLOCK_V)
        if SPARSE:
            ids = tl.load(qid_ptr + qrow * C + pc, mask=(pc < C) & has_q, other=-1)
            probs = tl.load(qp_ptr + qrow * C + pc, mask=(pc < C) & has_q, other=0.0)
        else:  # unused: dense q is read tile by tile
            ids = tl.full((C_PAD,), -1, tl.int32)
            probs = tl.zeros((C_PAD,), tl.float32)
        # pass 1: the residual's mass (and p's, for the all-zero fallback)
        mass_r = tl.zeros((BLOCK_V,), tl.float32)
        mass_p = tl.zeros((BLOCK_V,), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + offs
            p, q = _tile_p_q(logits_ptr, qp_ptr, ids, probs, row, qrow, v, has_q, best, norm,
                             inv_temp, V, SPARSE)
            mass_r += tl.maximum(p - q, 0.0)
            mass_p += p
        total_r = tl.sum(mass_r, 0)
        use_p = total_r <= 0.0
        total = tl.where(use_p, tl.sum(mass_p, 0), total_r)
        threshold = tl.load(un_ptr + b) * total
        # pass 2: the inverse CDF
        running = tl.sum(mass_p, 0) * 0.0
        result = n * 0 + V
        last = n * 0 - 1
        for v0 in range(0, V, BLOCK_V):
            v = v0 + offs
            p, q = _tile_p_q(logits_ptr, qp_ptr, ids, probs, row, qrow, v, has_q, best, norm,
                             inv_temp, V, SPARSE)
            w = tl.where(use_p, p, tl.maximum(p - q, 0.0))
            cdf = tl.cumsum(w, 0) + running
            first = tl.min(tl.where((cdf > threshold) & (w > 0), v, V), 0)
            result = tl.where(result == V, first, result)
            last = tl.maximum(last, tl.max(tl.where(w > 0, v, -1), 0))
            running += tl.sum(w, 0)
        tl.store(next_ptr + b, tl.where(result == V, last, result))


def accept(logits: torch.Tensor, draft_tokens: torch.Tensor, q_ids: torch.Tensor | None,
           q_probs: torch.Tensor, temperature: float, u_accept: torch.Tensor,
           u_next: torch.Tensor, *, block_v: int = 1024):
    """logits [B, K, V] (already warped when top-k/top-p apply), draft_tokens [B, S],
    q sparse (ids, probs [B, S, C]) or dense (None, [B, S, V]) -> (n [B], next [B])."""
    b, k, v = logits.shape
    s = k - 1
    logits = logits.contiguous()
    greedy = temperature <= 0
    inv_temp = 1.0 if greedy else 1.0 / temperature
    stats_max = torch.empty(b * k, dtype=torch.float32, device=logits.device)
    stats_arg = torch.empty(b * k, dtype=torch.int32, device=logits.device)
    stats_sum = torch.empty(b * k, dtype=torch.float32, device=logits.device)
    block_v = min(block_v, next_power_of_2(v))
    _row_stats[(b * k,)](logits, stats_max, stats_arg, stats_sum, inv_temp, V=v,
                         BLOCK_V=block_v)
    sparse = q_ids is not None
    c = q_ids.shape[-1] if sparse else 1
    n = torch.empty(b, dtype=torch.int32, device=logits.device)
    nxt = torch.empty(b, dtype=torch.int32, device=logits.device)
    ids = q_ids.to(torch.int32).contiguous() if sparse else draft_tokens
    _accept[(b,)](logits, draft_tokens.to(torch.int32).contiguous(), ids,
                  q_probs.float().contiguous(), stats_max, stats_arg, stats_sum,
                  u_accept.float().contiguous(), u_next.float().contiguous(), n, nxt,
                  inv_temp, c, S=s, V=v, GREEDY=greedy, SPARSE=sparse,
                  C_PAD=next_power_of_2(c, minimum=2),
                  BLOCK_V=min(block_v, 256))   # a [BLOCK_V, C] id compare per tile
    return n.long(), nxt.long()
