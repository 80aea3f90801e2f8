"""DSpine's proposal: top-C per slot over the vocabulary, the C x C transition scores,
the chain walk (T = 0 argmax; T > 0 the target's warp: temperature, top-k, top-p), as
token ids and sparse q. One entry point, `propose_chain(..., implementation=...)`; the
pieces (`vocab_topk`, `transition_table`, `chain_walk`) switch the same way.

Shape legend: B batch, S drafted slots, C candidates, D hidden, V vocab, N = B * S.
"""

from __future__ import annotations

import torch

from dspine_torch.kernels.common import check_implementation
from dspine_torch.kernels.dspine_proposal import reference
from dspine_torch.kernels.dspine_proposal.reference import (ChainHead, ChainProposal,
                                                            gated_messages, token_codes)

__all__ = ["ChainHead", "ChainProposal", "propose_chain", "vocab_topk", "transition_table",
           "chain_walk", "gated_messages", "token_codes"]


def _kernels():
    from dspine_torch.kernels.dspine_proposal import triton_kernel

    return triton_kernel


def vocab_topk(hidden: torch.Tensor, lm_head: torch.Tensor, c: int, *,
               implementation: str = "torch"):
    """hidden [N, D], lm_head [V, D] -> (values [N, C] float32, ids [N, C] int64)."""
    check_implementation(implementation, hidden, lm_head)
    if implementation == "torch":
        return reference.vocab_topk(hidden, lm_head, c)
    return _kernels().vocab_topk(hidden, lm_head, c)


def transition_table(head: ChainHead, pre_injection: torch.Tensor, gu: torch.Tensor,
                     candidates: torch.Tensor, lm_head: torch.Tensor, *,
                     implementation: str = "torch") -> torch.Tensor:
    """pre_injection [N, D], gu [N, C, m], candidates [N, C] -> [N, C, C] float32."""
    check_implementation(implementation, pre_injection, lm_head)
    if implementation == "torch":
        return reference.transition_table(head, pre_injection, gu, candidates, lm_head)
    return _kernels().transition_table(head, pre_injection, gu, candidates, lm_head)


def chain_walk(table: torch.Tensor, candidates: torch.Tensor, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, uniforms: torch.Tensor | None = None, *,
               implementation: str = "torch"):
    """table [B, S, C, C], candidates [B, S, C], uniforms [B, S] (needed at T > 0) ->
    (tokens [B, S], q [B, S, C], index [B, S])."""
    check_implementation(implementation, table)
    if uniforms is None:
        if temperature > 0:
            raise ValueError("chain_walk at temperature > 0 needs uniforms [B, S]")
        uniforms = torch.zeros(table.shape[:2], device=table.device)
    if implementation == "torch":
        return reference.chain_walk(table, candidates, temperature, top_p, top_k, uniforms)
    return _kernels().chain_walk(table, candidates, temperature, top_p, top_k, uniforms)


def propose_chain(hidden: torch.Tensor, pre_injection: torch.Tensor, anchor: torch.Tensor,
                  lm_head: torch.Tensor, head: ChainHead, num_candidates: int,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                  uniforms: torch.Tensor | None = None, *,
                  implementation: str = "torch") -> ChainProposal:
    """hidden [B, S, D] (the drafted slots after the final norm), pre_injection [B, S, D]
    (the last layer before its write), anchor [B] -> ChainProposal (ids, sparse q, the
    candidates that are q's support, the transition table)."""
    check_implementation(implementation, hidden, lm_head)
    b, s, d = hidden.shape
    c = min(num_candidates, lm_head.shape[0])
    _, candidates = vocab_topk(hidden.reshape(b * s, d), lm_head, c,
                               implementation=implementation)
    candidates = candidates.reshape(b, s, c)
    preds = torch.cat([anchor[:, None, None].expand(b, 1, c), candidates[:, :-1]], 1)
    flat = pre_injection.reshape(b * s, d)
    gu = gated_messages(head, flat, preds.reshape(b * s, c), lm_head)
    table = transition_table(head, flat, gu, candidates.reshape(b * s, c), lm_head,
                             implementation=implementation).reshape(b, s, c, c)
    tokens, q, index = chain_walk(table, candidates, temperature, top_p, top_k, uniforms,
                                  implementation=implementation)
    return ChainProposal(tokens=tokens, candidates=candidates, q=q, table=table, index=index)
