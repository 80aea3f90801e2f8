"""The verification rule of one block, in plain PyTorch: what the Triton kernel computes.

Row b drafted d_1 .. d_S from q_1 .. q_S; the target's logits over [anchor, d_1 .. d_S]
are l_0 .. l_S [V]. With p_i the target's distribution after position i:

  T = 0   p_i = one-hot(argmax l_i); keep d_i while d_i == argmax l_{i-1}; the next
          token is argmax l_n (n = drafts kept).
  T > 0   p_i = softmax(warp(l_i)) (temperature, top-k, top-p: the warp q got too);
          keep d_i with probability min(1, p(d_i) / q(d_i)), tested as u_i q < p; the next
          token is drawn (inverse CDF at u_next) from p_S if all S were kept (the bonus),
          else from the residual norm(max(0, p_n - q_n)) (p_n where that is all zero).

q is sparse (ids [B, S, C] and probabilities [B, S, C]: DSpine's candidates) or dense
([B, S, V], ids None: DFlash's slot softmax).

Shape legend: B batch, S drafted slots, K = S + 1, V vocab, C entries of sparse q.
"""

from __future__ import annotations

import torch

from dspine_torch.kernels.common import inverse_cdf, warp_logits


def dense_q(q_ids: torch.Tensor | None, q_probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, S, V] from sparse (ids, probs) or dense probs."""
    if q_ids is None:
        return q_probs.float()
    out = torch.zeros(*q_probs.shape[:2], vocab, device=q_probs.device)
    return out.scatter(-1, q_ids.long(), q_probs.float())


def target_probabilities(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                         top_k: int = 0) -> torch.Tensor:
    """p [..., V]: the one-hot argmax at T = 0, else softmax(warp(logits))."""
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(warp_logits(logits, temperature, top_p, top_k), -1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); p itself where that is all zero."""
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def accept(logits: torch.Tensor, draft_tokens: torch.Tensor, q_ids: torch.Tensor | None,
           q_probs: torch.Tensor, temperature: float, top_p: float, top_k: int,
           u_accept: torch.Tensor, u_next: torch.Tensor):
    """logits [B, K, V]; draft_tokens [B, S]; q (sparse or dense); u_accept [B, S];
    u_next [B] -> (num_accepted [B] int64, next_token [B] int64)."""
    b, k, vocab = logits.shape
    s = k - 1
    rows = torch.arange(b, device=logits.device)
    if temperature <= 0:
        target = logits.argmax(-1)                                          # [B, K]
        kept = (draft_tokens == target[:, :s]).long()
        n = torch.cumprod(kept, 1).sum(1)
        return n, target[rows, n]
    p = target_probabilities(logits, temperature, top_p, top_k)             # [B, K, V]
    q = dense_q(q_ids, q_probs, vocab)                                      # [B, S, V]
    p_draft = p[:, :s].gather(-1, draft_tokens[..., None].long())[..., 0]
    q_draft = q.gather(-1, draft_tokens[..., None].long())[..., 0]
    kept = (u_accept * q_draft < p_draft).long()
    n = torch.cumprod(kept, 1).sum(1)
    q_next = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, n]         # zero after all S
    dist = residual(p[rows, n], q_next)
    return n, inverse_cdf(dist, u_next)
