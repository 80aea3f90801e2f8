"""DSpine's gated adjacent injection after one drafter layer, in plain PyTorch: what the
Triton kernel computes (design doc section 4).

  phi_i = sqrt(r) normalise(R_l h_i)                         [B, K, r]
  p_1   = sqrt(r) c_anchor;  p_i = phi_{i-1} for i >= 2      (slot 0 gets no write)
  g_i   = sigmoid(A phi_i + B p_i + b)                       [B, K, m]
  h_i  <- h_i + rms(h_i) W_l (g_i * M p_i),   rms(h) = |h| / sqrt(D)

The dtype steps follow `DSpineDraftModel.after_layer` exactly (linear maps in the
drafter's dtype, the norms and the gate in float32).

Shape legend: B batch, K block size, D hidden, r transfer rank, m message width.
"""

from __future__ import annotations

import math

import torch


def readout(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """R_l h [B, K, r] float32 (the matmul both implementations share)."""
    return (h @ weight.to(h.dtype).T).float()


def inject(h: torch.Tensor, anchor_code: torch.Tensor, readout_weight: torch.Tensor,
           receiver_gate: torch.Tensor, predecessor_gate: torch.Tensor, bias: torch.Tensor,
           message: torch.Tensor, write: torch.Tensor):
    """h [B, K, D]; anchor_code [B, r] = sqrt(r) c_anchor (float32); weights as in
    nn.Linear ([out, in]) -> (h after the write [B, K, D], gate [B, K, m] float32)."""
    dtype = h.dtype
    rank = readout_weight.shape[0]
    z = readout(h, readout_weight)
    phi = math.sqrt(rank) * z / z.norm(dim=-1, keepdim=True).clamp(min=1e-6)
    code = anchor_code.float()[:, None]
    pred = torch.cat([code, code, phi[:, 1:-1]], 1)
    gate = torch.sigmoid((phi.to(dtype) @ receiver_gate.to(dtype).T
                          + pred.to(dtype) @ predecessor_gate.to(dtype).T
                          + bias.to(dtype)).float())
    msg = (pred.to(dtype) @ message.to(dtype).T).float()
    rms = h.float().pow(2).mean(-1, keepdim=True).sqrt()
    delta = (rms * ((gate * msg).to(dtype) @ write.to(dtype).T).float()).to(dtype)
    not_anchor = (torch.arange(h.shape[1], device=h.device) > 0)[None, :, None]
    return h + torch.where(not_anchor, delta, torch.zeros_like(delta)), gate
