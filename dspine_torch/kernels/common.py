"""What every kernel folder shares: the implementation switch, the sampling warp (the
same warp the target's p gets), inverse-CDF sampling from given uniforms, and padding
helpers for Triton's power-of-two block shapes.

Shape legend: R rows, C entries per row (candidates or vocabulary).
"""

from __future__ import annotations

import os

import torch

IMPLEMENTATIONS = ("torch", "triton")


def check_implementation(implementation: str, *tensors: torch.Tensor) -> None:
    """Refuse an unknown implementation, and Triton on CPU tensors outside the
    interpreter, with a sentence that says what to do."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    if implementation == "triton":
        on_cpu = any(t is not None and t.device.type != "cuda" for t in tensors)
        if on_cpu and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError("implementation='triton' needs CUDA tensors, or CPU tensors "
                             "with TRITON_INTERPRET=1 set before the kernels are imported")


def next_power_of_2(n: int, minimum: int = 16) -> int:
    """Triton block sizes are powers of two; tl.dot needs every dimension >= 16."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def warp_logits(logits: torch.Tensor, temperature, top_p=1.0, top_k=0) -> torch.Tensor:
    """Temperature, then top-k, then top-p (transformers' order); -inf outside the kept
    set. [..., C] float32. The same rule as `dspine_torch.modeling_dspine.warp_logits`
    (a test holds them equal); kernels keep their own copy to import nothing of the
    library. Each parameter is a number, or a tensor of logits' leading shape (one value
    per row; a row's temperature <= 0 means 1, its top_k <= 0 means all)."""
    if torch.is_tensor(temperature):
        t = temperature.to(logits.device, torch.float32)[..., None]
        scaled = logits.float() / torch.where(t > 0, t, torch.ones_like(t))
    else:
        scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    width = scaled.shape[-1]
    if torch.is_tensor(top_k):
        k = top_k.to(logits.device, torch.long)[..., None]
        k = torch.where(k > 0, k.clamp(max=width), width)
    else:
        k = min(top_k, width) if top_k > 0 else width
    if torch.is_tensor(top_p):
        top_p = top_p.to(logits.device, torch.float32)[..., None]
    sorted_desc = torch.sort(scaled, -1, descending=True).values
    rank = torch.arange(width, device=scaled.device)
    sorted_desc = torch.where(rank < k, sorted_desc, float("-inf"))
    probs = torch.softmax(sorted_desc, -1)
    keep = ((torch.cumsum(probs, -1) - probs) < top_p) & (rank < k)
    n_keep = keep.sum(-1, keepdim=True).clamp(min=1)
    threshold = torch.gather(sorted_desc, -1, n_keep - 1)
    return torch.where(scaled >= threshold, scaled, float("-inf"))


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [R, C] >= 0 (not necessarily normalised), u [R] in [0, 1) -> index [R]:
    the first entry whose running sum exceeds u * total, never an entry of zero weight
    (rounding that runs past the end lands on the last positive entry)."""
    cdf = torch.cumsum(weights, -1)
    threshold = u * cdf[:, -1]
    index = (cdf <= threshold[:, None]).sum(-1)
    positions = torch.arange(weights.shape[-1], device=weights.device)
    last = torch.where(weights > 0, positions, -1).max(-1).values
    return torch.minimum(index, last)
