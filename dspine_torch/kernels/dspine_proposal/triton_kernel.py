"""Triton kernels of DSpine's proposal (see reference.py for the math).

  _tile_topk      grid (N / BLOCK_N, V / BLOCK_V): one lm_head tile's logits for a block
                  of slots (tl.dot over D chunks, float32 accumulation), then its top-C by
                  C rounds of argmax-and-mask. The [N, V] logits never exist: only the
                  [N, V / BLOCK_V, C] partial winners go to memory; torch.topk merges
                  those (V / BLOCK_V * C per slot, ~6% of V at BLOCK_V = 256, C = 16).
  _transition     grid (N,): for one slot, the write redone for every predecessor
                  (gu @ W_L^T), the residual add, the final RMSNorm and the dot with the
                  C candidates' lm_head rows (gathered by id inside the kernel), one pass
                  over D; scores = rsqrt(mean(x^2) + eps) * sum_d x w_norm e_b.
  _chain_walk     grid (B,): the walk over S slots; per slot the warp (temperature,
                  top-k, top-p via tl.sort and tl.cumsum over the C scores), the softmax,
                  the inverse-CDF draw with the given uniform (argmax at T = 0), and the
                  sparse q row.

The gate/message prelude (codes of the predecessors, three r x m products) stays in
PyTorch (reference.gated_messages): it is [N, C, r] x [r, m], small next to the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspine_torch.kernels.common import next_power_of_2


@triton.jit
def _tile_topk(h_ptr, w_ptr, val_ptr, idx_ptr, N, V, stride_h, stride_w, n_tiles,
               D: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
               BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        h = tl.load(h_ptr + rows[:, None] * stride_h + dd[None, :],
                    mask=(rows[:, None] < N) & (dd[None, :] < D), other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_w + dd[None, :],
                    mask=(cols[:, None] < V) & (dd[None, :] < D), other=0.0)
        # float32 operands: exact for bf16 values under tf32, and Triton's interpreter
        # cannot multiply bf16 blocks
        acc = tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                     input_precision=PRECISION)
    acc = tl.where(cols[None, :] < V, acc, float("-inf"))
    local = tl.arange(0, BLOCK_V)
    out = (rows * n_tiles + pid_v) * C
    for c in tl.static_range(C):
        best, at = tl.max(acc, 1, return_indices=True)           # [BLOCK_N]
        tl.store(val_ptr + out + c, best, mask=rows < N)
        tl.store(idx_ptr + out + c, pid_v * BLOCK_V + at, mask=rows < N)
        acc = tl.where(local[None, :] == at[:, None], float("-inf"), acc)


def vocab_topk(hidden: torch.Tensor, lm_head: torch.Tensor, c: int, *, block_n: int = 16,
               block_v: int = 256, block_d: int = 64):
    """hidden [N, D], lm_head [V, D] -> (values [N, C] float32, ids [N, C] int64)."""
    n, d = hidden.shape
    v = lm_head.shape[0]
    if hidden.dtype != lm_head.dtype:
        hidden, lm_head = hidden.float(), lm_head.float()
    hidden, lm_head = hidden.contiguous(), lm_head.contiguous()
    block_v = min(block_v, next_power_of_2(v))
    block_d = min(block_d, next_power_of_2(d))
    n_tiles = triton.cdiv(v, block_v)
    c_tile = min(c, block_v)
    vals = torch.empty(n, n_tiles, c_tile, dtype=torch.float32, device=hidden.device)
    idx = torch.empty(n, n_tiles, c_tile, dtype=torch.int32, device=hidden.device)
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(n, block_n), n_tiles)
    _tile_topk[grid](hidden, lm_head, vals, idx, n, v, hidden.stride(0), lm_head.stride(0),
                     n_tiles, D=d, C=c_tile, BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_D=block_d,
                     PRECISION=precision)
    values, at = torch.topk(vals.reshape(n, -1), c, dim=-1)
    return values, idx.reshape(n, -1).gather(1, at).long()


@triton.jit
def _transition(h_ptr, gu_ptr, w_ptr, nw_ptr, e_ptr, cand_ptr, out_ptr, M, C, eps,
                stride_h, stride_w, stride_e, D: tl.constexpr,
                C_PAD: tl.constexpr, M_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                PRECISION: tl.constexpr):
    s = tl.program_id(0)
    pc = tl.arange(0, C_PAD)
    mm = tl.arange(0, M_PAD)
    # rms(h) of the slot's pre-injection state
    ss_h = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        h = tl.load(h_ptr + s * stride_h + dd, mask=dd < D, other=0.0).to(tl.float32)
        ss_h += h * h
    rms = tl.sqrt(tl.sum(ss_h, 0) / D)
    gu = tl.load(gu_ptr + (s * C + pc[:, None]) * M + mm[None, :],
                 mask=(pc[:, None] < C) & (mm[None, :] < M), other=0.0)   # [C_PAD, M_PAD]
    ids = tl.load(cand_ptr + s * C + pc, mask=pc < C, other=0)            # [C_PAD]
    dots = tl.zeros((C_PAD, C_PAD), dtype=tl.float32)
    ss = tl.zeros((C_PAD,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        dmask = dd < D
        w = tl.load(w_ptr + dd[:, None] * stride_w + mm[None, :],
                    mask=dmask[:, None] & (mm[None, :] < M), other=0.0).to(tl.float32)
        delta = tl.dot(gu, tl.trans(w), input_precision=PRECISION)     # [C_PAD, BLOCK_D]
        h = tl.load(h_ptr + s * stride_h + dd, mask=dmask, other=0.0).to(tl.float32)
        x = h[None, :] + rms * delta
        ss += tl.sum(x * x, 1)
        nw = tl.load(nw_ptr + dd, mask=dmask, other=0.0).to(tl.float32)
        e = tl.load(e_ptr + ids[:, None] * stride_e + dd[None, :],
                    mask=(pc[:, None] < C) & dmask[None, :], other=0.0).to(tl.float32)
        dots = tl.dot(x * nw[None, :], tl.trans(e), dots, input_precision=PRECISION)
    scores = dots * tl.rsqrt(ss / D + eps)[:, None]
    tl.store(out_ptr + (s * C + pc[:, None]) * C + pc[None, :], scores,
             mask=(pc[:, None] < C) & (pc[None, :] < C))


def transition_table(head, pre_injection: torch.Tensor, gu: torch.Tensor,
                     candidates: torch.Tensor, lm_head: torch.Tensor, *,
                     block_d: int = 32) -> torch.Tensor:
    """pre_injection [N, D], gu [N, C, m], candidates [N, C] -> scores [N, C, C] float32."""
    n, d = pre_injection.shape
    c, m = candidates.shape[1], gu.shape[-1]
    assert gu.shape[1] == c, "the kernel scores C predecessors against C candidates"
    h = pre_injection.contiguous()
    write = head.write.contiguous()
    out = torch.empty(n, c, c, dtype=torch.float32, device=h.device)
    _transition[(n,)](h, gu.float().contiguous(), write, head.norm_weight.contiguous(),
                      lm_head.contiguous(), candidates.to(torch.int32).contiguous(), out,
                      m, c, float(head.eps), h.stride(0), write.stride(0),
                      lm_head.stride(0), D=d, C_PAD=next_power_of_2(c), M_PAD=next_power_of_2(m),
                      BLOCK_D=min(block_d, next_power_of_2(d)), PRECISION="ieee")
    return out


@triton.jit
def _chain_walk(table_ptr, cand_ptr, u_ptr, tok_ptr, q_ptr, index_ptr, C, inv_temp,
                top_p, top_k, S: tl.constexpr, GREEDY: tl.constexpr, C_PAD: tl.constexpr):
    b = tl.program_id(0)
    pc = tl.arange(0, C_PAD)
    valid = pc < C
    index = tl.program_id(0) * 0                                    # the anchor's row
    for i in range(S):
        base = ((b * S + i) * C + index) * C
        scores = tl.load(table_ptr + base + pc, mask=valid, other=float("-inf"))
        if GREEDY:
            choice = tl.argmax(scores, 0)
            probs = tl.where(pc == choice, 1.0, 0.0)
        else:
            scaled = scores * inv_temp
            ordered = tl.sort(scaled, 0, descending=True)
            ordered = tl.where(pc < top_k, ordered, float("-inf"))
            e = tl.exp(ordered - tl.max(ordered, 0))
            p_sorted = e / tl.sum(e, 0)
            before = tl.cumsum(p_sorted, 0) - p_sorted
            keep = (before < top_p) & (pc < top_k)
            n_keep = tl.maximum(tl.sum(keep.to(tl.int32), 0), 1)
            threshold = tl.sum(tl.where(pc == n_keep - 1, ordered, 0.0), 0)
            warped = tl.where(scaled >= threshold, scaled, float("-inf"))
            e = tl.exp(warped - tl.max(warped, 0))
            probs = e / tl.sum(e, 0)
            u = tl.load(u_ptr + b * S + i)
            cdf = tl.cumsum(probs, 0)
            drawn = tl.sum((cdf <= u * tl.sum(probs, 0)).to(tl.int32), 0)
            last = tl.max(tl.where(probs > 0, pc, -1), 0)
            choice = tl.minimum(drawn, last)
        tl.store(q_ptr + (b * S + i) * C + pc, probs, mask=valid)
        tl.store(tok_ptr + b * S + i, tl.load(cand_ptr + (b * S + i) * C + choice))
        tl.store(index_ptr + b * S + i, choice)
        index = choice


def chain_walk(table: torch.Tensor, candidates: torch.Tensor, temperature: float,
               top_p: float, top_k: int, uniforms: torch.Tensor):
    """table [B, S, C, C], candidates [B, S, C], uniforms [B, S] -> (tokens [B, S],
    q [B, S, C], index [B, S])."""
    b, s, c, _ = table.shape
    tokens = torch.empty(b, s, dtype=torch.long, device=table.device)
    q = torch.empty(b, s, c, dtype=torch.float32, device=table.device)
    index = torch.empty(b, s, dtype=torch.int32, device=table.device)
    greedy = temperature <= 0
    _chain_walk[(b,)](table.float().contiguous(), candidates.contiguous(),
                      uniforms.float().contiguous(), tokens, q, index, c,
                      1.0 if greedy else 1.0 / temperature, float(top_p),
                      int(top_k) if top_k > 0 else c, S=s, GREEDY=greedy,
                      C_PAD=next_power_of_2(c, minimum=2))
    return tokens, q, index.long()
