"""The verification rule of a block: argmax prefix at T = 0, speculative sampling with
the residual at T > 0, given sparse q (DSpine: ids and probabilities over the candidates)
or dense q (DFlash). One entry point, `accept(..., implementation=...)`.

Randomness comes in as uniforms (u_accept [B, S], u_next [B]), so both implementations
draw the same tokens from the same numbers.

Shape legend: B batch, S drafted slots, K = S + 1, V vocab, C entries of sparse q.
"""

from __future__ import annotations

import torch

from dspine_torch.kernels.acceptance import reference
from dspine_torch.kernels.common import check_implementation, warp_logits

__all__ = ["accept"]


def accept(logits: torch.Tensor, draft_tokens: torch.Tensor, q_ids: torch.Tensor | None,
           q_probs: torch.Tensor | None, temperature: float = 0.0, top_p: float = 1.0,
           top_k: int = 0, u_accept: torch.Tensor | None = None,
           u_next: torch.Tensor | None = None, *, implementation: str = "torch"):
    """logits [B, K, V] the target's over [anchor, drafts]; draft_tokens [B, S]; q as
    (q_ids [B, S, C], q_probs [B, S, C]) or (None, q_probs [B, S, V]); unused at T = 0.
    Returns (drafts kept [B], the target's next token [B]), both int64."""
    check_implementation(implementation, logits)
    b, k, _ = logits.shape
    if temperature > 0 and (u_accept is None or u_next is None or q_probs is None):
        raise ValueError("accept at temperature > 0 needs q, u_accept [B, S] and u_next [B]")
    if temperature <= 0:
        u_accept = torch.zeros(b, k - 1, device=logits.device)
        u_next = torch.zeros(b, device=logits.device)
        if q_probs is None:
            q_ids, q_probs = draft_tokens[..., None], torch.ones(b, k - 1, 1,
                                                                 device=logits.device)
    if implementation == "torch":
        return reference.accept(logits, draft_tokens, q_ids, q_probs, temperature, top_p,
                                top_k, u_accept, u_next)
    from dspine_torch.kernels.acceptance import triton_kernel

    if temperature > 0 and (top_k > 0 or top_p < 1.0):
        logits, temperature = warp_logits(logits, temperature, top_p, top_k), 1.0
    return triton_kernel.accept(logits, draft_tokens, q_ids, q_probs, temperature, u_accept,
                                u_next)
