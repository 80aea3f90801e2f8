"""DSpine's gated adjacent injection of one drafter layer (readout, gate, message,
residual write), with `inject(..., implementation="torch" | "triton")`.

Shape legend: B batch, K block size, D hidden, r transfer rank, m message width.
"""

from __future__ import annotations

import torch

from dspine_torch.kernels.common import check_implementation
from dspine_torch.kernels.gated_injection import reference

__all__ = ["inject"]


def inject(h: torch.Tensor, anchor_code: torch.Tensor, readout_weight: torch.Tensor,
           receiver_gate: torch.Tensor, predecessor_gate: torch.Tensor, bias: torch.Tensor,
           message: torch.Tensor, write: torch.Tensor, *, implementation: str = "torch"):
    """h [B, K, D]; anchor_code [B, r] = sqrt(r) c_anchor; weights [out, in] ->
    (h after the write [B, K, D], gate [B, K, m] float32)."""
    check_implementation(implementation, h)
    args = (h, anchor_code, readout_weight, receiver_gate, predecessor_gate, bias, message,
            write)
    if implementation == "torch":
        return reference.inject(*args)
    from dspine_torch.kernels.gated_injection import triton_kernel

    return triton_kernel.inject(*args)
