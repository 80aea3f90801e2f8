"""Triton kernel of DSpine's gated injection (see reference.py for the math).

The readout R_l h ([B, K, D] x [D, r]) is one cuBLAS matmul (torch). Then one kernel,
grid (B, D / BLOCK_D): each program normalises the block's readouts into phi, forms the
predecessors by loading the readouts one slot back (the anchor's code for slots 0 and 1),
computes the gate and the message (three [K, r] x [r, m] products over r in BLOCK_R
chunks, recomputed by every D tile: r x m weights are small and stay in L2), then writes
its D tile:
h + rms(h) * (g * u) @ W_l^T for slots >= 1. One launch instead of ~12.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dspine_torch.kernels.common import next_power_of_2


@triton.jit
def _inject(h_ptr, z_ptr, code_ptr, a_ptr, bg_ptr, bias_ptr, m_ptr, w_ptr, out_ptr, gate_ptr,
            K, M, scale, R: tl.constexpr, K_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
            M_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
            PRECISION: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)
    kk = tl.arange(0, K_PAD)
    mm = tl.arange(0, M_PAD)
    rows = kk[:, None] < K
    prev = (kk[:, None] >= 2) & rows
    # |R_l h| of every slot and of the slot before it (phi = sqrt(r) z / |z|)
    ssz = tl.zeros((K_PAD,), tl.float32)
    ssp = tl.zeros((K_PAD,), tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        z = tl.load(z_ptr + (b * K + kk[:, None]) * R + rr[None, :],
                    mask=rows & (rr[None, :] < R), other=0.0)
        zp = tl.load(z_ptr + (b * K + kk[:, None] - 1) * R + rr[None, :],
                     mask=prev & (rr[None, :] < R), other=0.0)
        ssz += tl.sum(z * z, 1)
        ssp += tl.sum(zp * zp, 1)
    inv = scale / tl.maximum(tl.sqrt(ssz), 1e-6)
    inv_prev = scale / tl.maximum(tl.sqrt(ssp), 1e-6)
    # gate logits and messages, r in chunks. Operands are rounded to the weights' dtype
    # (as the reference's linear maps are), then multiplied in float32: tf32 holds bf16
    # values exactly, and Triton's interpreter cannot multiply bf16 blocks.
    logit = tl.zeros((K_PAD, M_PAD), tl.float32)
    msg = tl.zeros((K_PAD, M_PAD), tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        rmask = rr < R
        z = tl.load(z_ptr + (b * K + kk[:, None]) * R + rr[None, :],
                    mask=rows & rmask[None, :], other=0.0)
        zp = tl.load(z_ptr + (b * K + kk[:, None] - 1) * R + rr[None, :],
                     mask=prev & rmask[None, :], other=0.0)
        code = tl.load(code_ptr + b * R + rr, mask=rmask, other=0.0)
        phi = z * inv[:, None]
        pred = tl.where(kk[:, None] >= 2, zp * inv_prev[:, None], code[None, :])
        wmask = (mm[:, None] < M) & rmask[None, :]
        a = tl.load(a_ptr + mm[:, None] * R + rr[None, :], mask=wmask, other=0.0)
        bg = tl.load(bg_ptr + mm[:, None] * R + rr[None, :], mask=wmask, other=0.0)
        mw = tl.load(m_ptr + mm[:, None] * R + rr[None, :], mask=wmask, other=0.0)
        phi_w = phi.to(a.dtype).to(tl.float32)
        pred_w = pred.to(a.dtype).to(tl.float32)
        logit += tl.dot(phi_w, tl.trans(a.to(tl.float32)), input_precision=PRECISION)
        logit += tl.dot(pred_w, tl.trans(bg.to(tl.float32)), input_precision=PRECISION)
        msg += tl.dot(pred_w, tl.trans(mw.to(tl.float32)), input_precision=PRECISION)
    bias = tl.load(bias_ptr + mm, mask=mm < M, other=0.0).to(tl.float32)
    gate = tl.sigmoid(logit + bias[None, :])
    gu = gate * msg
    if j == 0:
        tl.store(gate_ptr + (b * K + kk[:, None]) * M + mm[None, :], gate,
                 mask=rows & (mm[None, :] < M))
    # rms(h) per slot over the full row
    ss = tl.zeros((K_PAD,), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(h_ptr + (b * K + kk[:, None]) * D + dd[None, :],
                    mask=(kk[:, None] < K) & (dd[None, :] < D), other=0.0).to(tl.float32)
        ss += tl.sum(x * x, 1)
    rms = tl.sqrt(ss / D)
    # this program's D tile
    dd = j * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = dd < D
    w = tl.load(w_ptr + dd[:, None] * M + mm[None, :], mask=dmask[:, None] & (mm[None, :] < M),
                other=0.0)
    delta = tl.dot(gu.to(w.dtype).to(tl.float32), tl.trans(w.to(tl.float32)),
                   input_precision=PRECISION)                              # [K_PAD, BLOCK_D]
    tile = (kk[:, None] < K) & dmask[None, :]
    x = tl.load(h_ptr + (b * K + kk[:, None]) * D + dd[None, :], mask=tile, other=0.0)
    delta = tl.where(kk[:, None] > 0, rms[:, None] * delta, 0.0)
    tl.store(out_ptr + (b * K + kk[:, None]) * D + dd[None, :],
             (x.to(tl.float32) + delta.to(x.dtype).to(tl.float32)).to(x.dtype), mask=tile)


def inject(h: torch.Tensor, anchor_code: torch.Tensor, readout_weight: torch.Tensor,
           receiver_gate: torch.Tensor, predecessor_gate: torch.Tensor, bias: torch.Tensor,
           message: torch.Tensor, write: torch.Tensor, *, block_d: int = 32,
           block_r: int = 32):
    """Same contract as reference.inject."""
    b, k, d = h.shape
    r, m = readout_weight.shape[0], message.shape[0]
    h = h.contiguous()
    z = (h @ readout_weight.to(h.dtype).T).float().contiguous()              # [B, K, r]
    dtype = h.dtype
    out = torch.empty_like(h)
    gate = torch.empty(b, k, m, dtype=torch.float32, device=h.device)
    block_d = min(block_d, next_power_of_2(d))
    precision = "ieee" if dtype == torch.float32 else "tf32"
    _inject[(b, triton.cdiv(d, block_d))](
        h, z, anchor_code.float().contiguous(), receiver_gate.to(dtype).contiguous(),
        predecessor_gate.to(dtype).contiguous(), bias.contiguous(),
        message.to(dtype).contiguous(), write.to(dtype).contiguous(), out, gate, k, m,
        math.sqrt(r), R=r, K_PAD=next_power_of_2(k), BLOCK_R=min(block_r, next_power_of_2(r)),
        M_PAD=next_power_of_2(m), D=d, BLOCK_D=block_d, PRECISION=precision)
    return out, gate
