"""DSpine's proposal in plain PyTorch: what the Triton kernels compute.

  1. top-C per slot:   ids, values = top_C(E_out @ hidden_s)           hidden [N, D] -> [N, C]
  2. transition table: for slot s, predecessor a (the anchor for slot 1, slot s-1's
     candidates after) and candidate b:
        phi  = sqrt(r) normalise(R_L h_s)                 h_s: the last layer before its write
        c_a  = sqrt(r) code(a)                            token code in the transfer space
        gu   = sigmoid(A phi + B c_a + bias) * (M c_a)                     [m]
        ref  = RMSNorm(h_s + rms(h_s) W_L gu)                              [D]
        score(b | s, a) = E_out[b] . ref                                   table [B, S, C, C]
  3. the walk from the anchor: slot s takes the row of its chosen predecessor and picks
     the argmax (T = 0) or draws from softmax(warp(row)) with the given uniform (inverse
     CDF); q_s is that distribution over slot s's C candidates (zero elsewhere: sparse q).

The dtype steps follow `DSpineDraftModel.transition_scores` exactly (linear layers in the
drafter's dtype, norms and sums in float32), so in float32 this equals the drafter.

Shape legend: B batch, S drafted slots (K-1), C candidates, D hidden, V vocab,
r transfer rank, m message width, N = B * S.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from dspine_torch.kernels.common import inverse_cdf, warp_logits


@dataclasses.dataclass(frozen=True)
class ChainHead:
    """The tensors of DSpine's decoding head (the last layer's readout and write, the
    shared gate/message, the final norm) and the transfer space that gives token codes
    (the whitening map, or a [V, r] code table)."""

    readout: torch.Tensor            # [r, D]  R_L
    receiver_gate: torch.Tensor      # [m, r]  A
    predecessor_gate: torch.Tensor   # [m, r]  B
    bias: torch.Tensor               # [m]
    message: torch.Tensor            # [m, r]  M
    write: torch.Tensor              # [D, m]  W_L
    norm_weight: torch.Tensor        # [D]
    eps: float
    whiten: torch.Tensor | None = None       # [D, r] float32
    mean: torch.Tensor | None = None         # [D] float32
    code_table: torch.Tensor | None = None   # [V, r] float32

    @property
    def rank(self) -> int:
        return self.readout.shape[0]


@dataclasses.dataclass
class ChainProposal:
    tokens: torch.Tensor      # [B, S] drafted tokens
    candidates: torch.Tensor  # [B, S, C] slot candidates (the support of q)
    q: torch.Tensor           # [B, S, C] float32: q_s over the candidates (sparse q)
    table: torch.Tensor       # [B, S, C, C] float32 transition scores
    index: torch.Tensor       # [B, S] the chosen candidate of each slot


def vocab_topk(hidden: torch.Tensor, lm_head: torch.Tensor, c: int):
    """hidden [N, D], lm_head [V, D] -> (values [N, C] float32, ids [N, C] int64),
    descending, through the full [N, V] logits."""
    logits = hidden.float() @ lm_head.float().T
    values, ids = torch.topk(logits, c, dim=-1)
    return values, ids


def token_codes(head: ChainHead, tokens: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """sqrt(r) c_token [..., r] float32."""
    if head.whiten is not None:
        rows = F.normalize(lm_head[tokens].float(), dim=-1, eps=1e-12)
        c = F.normalize((rows - head.mean.float()) @ head.whiten.float(), dim=-1, eps=1e-12)
    else:
        c = head.code_table.float()[tokens]
    return math.sqrt(head.rank) * c


def gated_messages(head: ChainHead, pre_injection: torch.Tensor, predecessors: torch.Tensor,
                   lm_head: torch.Tensor) -> torch.Tensor:
    """The gate times the message of every predecessor: pre_injection [N, D],
    predecessors [N, P] -> gu [N, P, m] float32 (the part both implementations share)."""
    dtype = pre_injection.dtype
    z = (pre_injection @ head.readout.to(dtype).T).float()                 # [N, r]
    phi = math.sqrt(head.rank) * z / z.norm(dim=-1, keepdim=True).clamp(min=1e-6)
    pred = token_codes(head, predecessors, lm_head).to(dtype)               # [N, P, r]
    gate = torch.sigmoid((phi.to(dtype)[:, None] @ head.receiver_gate.to(dtype).T
                          + pred @ head.predecessor_gate.to(dtype).T
                          + head.bias.to(dtype)).float())
    return gate * (pred @ head.message.to(dtype).T).float()                 # [N, P, m]


def transition_table(head: ChainHead, pre_injection: torch.Tensor, gu: torch.Tensor,
                     candidates: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """pre_injection [N, D], gu [N, P, m], candidates [N, C] -> scores [N, P, C] float32:
    the last layer's write redone per predecessor, the final RMSNorm, the dot with each
    candidate's lm_head row."""
    dtype = pre_injection.dtype
    h = pre_injection[:, None]                                              # [N, 1, D]
    rms = h.float().pow(2).mean(-1, keepdim=True).sqrt()
    delta = (rms * (gu.to(dtype) @ head.write.to(dtype).T).float()).to(dtype)
    x = h + delta                                                           # [N, P, D]
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + head.eps)).to(dtype)
    refined = normed * head.norm_weight.to(dtype)
    rows = lm_head[candidates].float()                                      # [N, C, D]
    return torch.einsum("npd,ncd->npc", refined.float(), rows)


def sample_rows(scores: torch.Tensor, temperature: float, top_p: float, top_k: int,
                u: torch.Tensor):
    """scores [R, C], u [R] -> (index [R], probs [R, C]): the argmax and its one-hot at
    T = 0, else the inverse-CDF draw from softmax(warp(scores))."""
    if temperature <= 0:
        index = scores.argmax(-1)
        return index, F.one_hot(index, scores.shape[-1]).float()
    probs = torch.softmax(warp_logits(scores, temperature, top_p, top_k), -1)
    return inverse_cdf(probs, u), probs


def chain_walk(table: torch.Tensor, candidates: torch.Tensor, temperature: float,
               top_p: float, top_k: int, uniforms: torch.Tensor):
    """table [B, S, C, C], candidates [B, S, C], uniforms [B, S] -> (tokens [B, S],
    q [B, S, C], index [B, S]). Slot 1's predecessor is the anchor (row 0)."""
    b, s, _, _ = table.shape
    rows = torch.arange(b, device=table.device)
    index = torch.zeros(b, dtype=torch.long, device=table.device)
    tokens, qs, chosen = [], [], []
    for i in range(s):
        index, probs = sample_rows(table[rows, i, index].float(), temperature, top_p, top_k,
                                   uniforms[:, i])
        tokens.append(candidates[rows, i, index])
        qs.append(probs)
        chosen.append(index)
    return torch.stack(tokens, 1), torch.stack(qs, 1), torch.stack(chosen, 1)


def propose_chain(hidden: torch.Tensor, pre_injection: torch.Tensor, anchor: torch.Tensor,
                  lm_head: torch.Tensor, head: ChainHead, num_candidates: int,
                  temperature: float, top_p: float, top_k: int,
                  uniforms: torch.Tensor) -> ChainProposal:
    """hidden [B, S, D] (final-normed, slots 1..K-1), pre_injection [B, S, D], anchor [B]."""
    b, s, d = hidden.shape
    c = min(num_candidates, lm_head.shape[0])
    _, candidates = vocab_topk(hidden.reshape(b * s, d), lm_head, c)
    candidates = candidates.reshape(b, s, c)
    preds = torch.cat([anchor[:, None, None].expand(b, 1, c), candidates[:, :-1]], 1)
    flat = pre_injection.reshape(b * s, d)
    gu = gated_messages(head, flat, preds.reshape(b * s, c), lm_head)
    table = transition_table(head, flat, gu, candidates.reshape(b * s, c), lm_head)
    table = table.reshape(b, s, c, c)
    tokens, q, index = chain_walk(table, candidates, temperature, top_p, top_k, uniforms)
    return ChainProposal(tokens=tokens, candidates=candidates, q=q, table=table, index=index)
