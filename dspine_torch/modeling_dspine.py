"""PyTorch DFlash and DSpine block drafters (inference), written from the design.

A drafter reads hidden states of several target layers ("features"), fuses them into one
vector per context position, and drafts a whole block [anchor, MASK, ..., MASK] in one
pass of a few Qwen3 decoder layers whose keys/values are [context features ; block]:

  fused      f = RMSNorm(W_fc concat(h^{l1}, ..., h^{ln}))                  [B, S, D]
  layer      Qwen3 layer; K/V = [k/v_proj(f) ; k/v_proj(norm(x))], queries from the block
  mask       the block sees the whole context; inside the block DFlash is bidirectional,
             DSpine causal (slot i sees slots <= i)
  logits     E_out norm(h_L)                                                 [B, K, V]

DSpine adds, after every layer l and for slots i >= 1, a gated write of the
predecessor's feature p_i (the anchor's token code for slot 1, phi_l(h_{i-1}) after):
  phi_l(h) = sqrt(r) normalise(R_l h),  g = sigmoid(A phi_l(h_i) + B p_i + b),
  h_i += rms(h_i) W_l (g * M p_i)
and a decoding head that scores the top-C candidates of slot i given each candidate of
slot i-1 (redoing the last layer's write with p = sqrt(r) c_a, then the final norm) and
walks the chain from the anchor. Token codes c_v live in a fixed r-dim "transfer space"
built from the target's lm_head: c_v = normalise((unit(E_out[v]) - mean) @ whiten).

The target's frozen tables E_in (input embedding) and E_out (lm_head rows) are arguments,
never parameters. Tensor names follow the DFlash/DSpine reference layout (`fc.weight`,
`layers.{i}.self_attn.q_proj.weight`, `injection.readouts.{l}.weight`, ...).

This file is shipped beside exported weights for `trust_remote_code=True`: it imports
only torch, transformers and its sibling configuration file.

Shape legend: B batch, S context length, K block size (slots), D hidden, N query heads,
G kv heads, H head dim, V vocab, r transfer rank, m message width, C candidates,
P predecessors.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from .configuration_dspine import DFlashDraftConfig, DSpineDraftConfig

# Fixed (never trained) DSpine tensors: kept in float32 whatever the weights' dtype. The
# code table is in the state dict (the reference layout); the whitening map, which
# checkpoints of the native layout hold instead, is attached by `load_drafter`.
TRANSFER_BUFFERS = ("transfer_whiten", "transfer_mean", "transfer_codes")
MAP_BUFFERS = ("transfer_whiten", "transfer_mean")


# ----- building blocks --------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Normalise in float32, cast back, then scale (HF's order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(x.dtype) * self.weight.to(x.dtype)


def rope_frequencies(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [H/2] float64 and the cos/sin scale for the config's RoPE."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    kind = params.get("rope_type", "default")
    dim = config.head_dim
    if kind == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    return inv_freq.double(), float(scale)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, N, H] in HF's half-split layout; cos/sin [B, T, H/2] float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, :, None], sin[:, :, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class DraftAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, h = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, h)
        self.q_proj = nn.Linear(d, self.num_heads * h, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * h, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * h, bias=False)
        self.o_proj = nn.Linear(self.num_heads * h, d, bias=False)
        self.q_norm = RMSNorm(h, config.rms_norm_eps)
        self.k_norm = RMSNorm(h, config.rms_norm_eps)

    def project_q(self, x, cos, sin):
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        return rotate(self.q_norm(q), cos, sin)

    def project_kv(self, x, cos, sin):
        """Keys (normed, rotated) and values [B, T, G, H]; also how context features
        become the drafter's context KV (they bypass the input norm, Q, O and the MLP)."""
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return rotate(self.k_norm(k), cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """x [B, K, D]; ctx_k/ctx_v [B, S, G, H]; mask [B, K, S + K] bool -> [B, K, D]."""
        b, t, _ = x.shape
        q = self.project_q(x, cos, sin)
        k, v = self.project_kv(x, cos, sin)
        keys = torch.cat([ctx_k, k.to(ctx_k.dtype)], 1)
        values = torch.cat([ctx_v, v.to(ctx_v.dtype)], 1)
        g = self.num_kv_heads
        q = q.unflatten(2, (g, self.num_heads // g))                       # [B, K, G, Q, H]
        # [B, G, Q, K, S + K], float32
        scores = torch.einsum("btgqh,bsgh->bgqts", q.float(), keys.float())
        scores = scores * self.head_dim ** -0.5
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
        probs = torch.softmax(scores, -1).to(values.dtype)
        out = torch.einsum("bgqts,bsgh->btgqh", probs, values)
        return self.o_proj(out.reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """A Qwen3 decoder layer whose keys/values are [context features ; block]."""

    def __init__(self, config):
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----- state and outputs --------------------------------------------------------------------
@dataclasses.dataclass
class DraftContext:
    """The drafter's context cache: per draft layer, K/V [B, S, G, H] of fused target
    features. Without `valid`, every row holds positions 0 .. S-1. A batch with ragged
    rows carries `valid` [B, S] bool (columns a row attends to; the others are holes it
    never reads) and `lengths` [B] (valid columns per row: the position its next feature
    takes)."""

    keys: list
    values: list
    valid: torch.Tensor | None = None
    lengths: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.keys[0].shape[1]

    def next_positions(self, count: int) -> torch.Tensor:
        """[B, count]: the positions of each row's next `count` entries."""
        b, device = self.keys[0].shape[0], self.keys[0].device
        steps = torch.arange(count, device=device)
        if self.lengths is None:
            return (self.length + steps).expand(b, -1)
        return self.lengths[:, None] + steps

    def select(self, rows: torch.Tensor) -> DraftContext:
        """The context of the given rows only (a finished row leaves the batch)."""
        pick = (lambda t: None if t is None else t[rows])
        return DraftContext(keys=[k[rows] for k in self.keys],
                            values=[v[rows] for v in self.values], valid=pick(self.valid),
                            lengths=pick(self.lengths))

    def trim(self) -> DraftContext:
        """Drop trailing columns that no row attends to."""
        if self.valid is None or self.length == 0:
            return self
        cols = torch.arange(1, self.length + 1, device=self.valid.device)
        end = int((self.valid * cols).max())
        if end == self.length:
            return self
        return DraftContext(keys=[k[:, :end] for k in self.keys],
                            values=[v[:, :end] for v in self.values],
                            valid=self.valid[:, :end], lengths=self.lengths)


@dataclasses.dataclass
class DraftOutput:
    logits: torch.Tensor | None         # [B, K, V] float32 base logits (slot 0 unused)
    hidden: torch.Tensor                # [B, K, D] after the final norm
    pre_injection: torch.Tensor | None  # [B, K, D] last layer before its injection (DSpine)
    gates: torch.Tensor | None          # [L] mean gate per layer over slots 1.. (DSpine)


@dataclasses.dataclass
class Proposal:
    tokens: torch.Tensor                 # [B, K-1] drafted tokens for slots 1 .. K-1
    q: torch.Tensor                      # [B, K-1, V] the distributions they were drawn from
    candidates: torch.Tensor | None = None  # [B, K-1, C] DSpine's candidates per slot
    table: torch.Tensor | None = None       # [B, K-1, C, C] DSpine's transition scores


# ----- sampling (the warp the target's p gets too) --------------------------------------------
def warp_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                top_k: int = 0) -> torch.Tensor:
    """Temperature, then top-k, then top-p (transformers' order); -inf outside the kept
    set. [..., V] float32."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    vocab = scaled.shape[-1]
    k = min(top_k, vocab) if top_k > 0 else vocab
    sorted_desc = torch.sort(scaled, -1, descending=True).values
    rank = torch.arange(vocab, device=scaled.device)
    sorted_desc = torch.where(rank < k, sorted_desc, float("-inf"))
    probs = torch.softmax(sorted_desc, -1)
    keep = ((torch.cumsum(probs, -1) - probs) < top_p) & (rank < k)
    n_keep = keep.sum(-1, keepdim=True).clamp(min=1)
    threshold = torch.gather(sorted_desc, -1, n_keep - 1)
    return torch.where(scaled >= threshold, scaled, float("-inf"))


def sample(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
           generator: torch.Generator | None = None):
    """logits [B, V] -> (choice [B], the distribution it came from [B, V]): the argmax and
    its one-hot at temperature 0, else a draw from the warped softmax."""
    if temperature <= 0:
        choice = logits.argmax(-1)
        return choice, F.one_hot(choice, logits.shape[-1]).float()
    probs = torch.softmax(warp_logits(logits, temperature, top_p, top_k), -1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0], probs


# ----- DFlash --------------------------------------------------------------------------------
class DFlashDraftModel(PreTrainedModel):
    config_class = DFlashDraftConfig
    base_model_prefix = "drafter"
    _no_split_modules = ["DraftLayer"]

    def __init__(self, config: DFlashDraftConfig):
        super().__init__(config)
        d = config.hidden_size
        self.block_size = config.block_size
        self.mask_token_id = config.mask_token_id
        self.target_layer_ids = config.target_layer_ids
        self.fc = nn.Linear(len(self.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList([DraftLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self._rope = None
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def rope(self, positions: torch.Tensor):
        """positions [B, T] -> cos, sin [B, T, H/2] float32."""
        if self._rope is None:
            self._rope = rope_frequencies(self.config)
        inv_freq, scale = self._rope
        angles = positions[..., None].float() * inv_freq.to(positions.device, torch.float32)
        return torch.cos(angles) * scale, torch.sin(angles) * scale

    # ----- context ---------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target features [B, T, F] -> [B, T, D]."""
        return self.hidden_norm(self.fc(features.to(self.compute_dtype)))

    def new_context(self, batch_size: int = 1) -> DraftContext:
        c = self.config
        empty = torch.zeros(batch_size, 0, c.num_key_value_heads, c.head_dim,
                            dtype=self.compute_dtype, device=self.fc.weight.device)
        return DraftContext(keys=[empty] * len(self.layers), values=[empty] * len(self.layers))

    def extend_context(self, context: DraftContext, features: torch.Tensor,
                       valid: torch.Tensor | None = None) -> DraftContext:
        """Append the features [B, T, F] of each row's next T positions. `valid` [B, T]
        bool (a prefix of each row) marks which of them are real; the rest become holes
        (their features are zeroed so that nothing non-finite reaches a masked column)."""
        if valid is not None:
            features = torch.where(valid[..., None], features, torch.zeros_like(features))
        fused = self.fuse(features)
        b, t = features.shape[:2]
        cos, sin = self.rope(context.next_positions(t))
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(fused, cos, sin)
            keys.append(torch.cat([context.keys[i], k], 1))
            values.append(torch.cat([context.values[i], v], 1))
        if valid is None and context.valid is None:
            return DraftContext(keys=keys, values=values)
        device = features.device
        if valid is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=device)
        old_valid = context.valid
        if old_valid is None:
            old_valid = torch.ones(b, context.length, dtype=torch.bool, device=device)
        lengths = context.lengths
        if lengths is None:
            lengths = torch.full((b,), context.length, dtype=torch.long, device=device)
        return DraftContext(keys=keys, values=values, valid=torch.cat([old_valid, valid], 1),
                            lengths=lengths + valid.sum(1))

    # ----- one block ---------------------------------------------------------------------------
    @property
    def causal_block(self) -> bool:
        return False

    def block_mask(self, batch: int, context_length: int, device,
                   valid: torch.Tensor | None = None) -> torch.Tensor:
        """[B, K, S + K]: the context (its valid columns, given `valid` [B, S]), and the
        block (causal for DSpine)."""
        k = self.block_size
        inside = torch.ones(k, k, dtype=torch.bool, device=device)
        if self.causal_block:
            inside = torch.tril(inside)
        ctx = torch.ones(batch, k, context_length, dtype=torch.bool, device=device)
        if valid is not None:
            ctx = ctx & valid[:, None, :]
        return torch.cat([ctx, inside.expand(batch, -1, -1)], 2)

    def forward(self, anchor: torch.Tensor, context: DraftContext, input_embedding: torch.Tensor,
                output_embedding: torch.Tensor, *, compute_logits: bool = True,
                inject=None) -> DraftOutput:
        """Draft one block per row: anchor [B] at the row's next position (context.length,
        or context.lengths for ragged rows); E_in, E_out
        [V, D] are the target's frozen tables. `compute_logits=False` skips the [B, K, V]
        base logits (a caller that takes top-C from `hidden` itself); `inject`, where
        given, replaces DSpine's write after each layer: (layer, h [B, K, D], sqrt(r)
        c_anchor [B, r]) -> (h after the write, gate [B, K, m]) (a fused kernel)."""
        b, k = anchor.shape[0], self.block_size
        tokens = torch.cat([anchor[:, None], anchor.new_full((b, k - 1), self.mask_token_id)], 1)
        x = input_embedding[tokens].to(self.compute_dtype)                 # [B, K, D]
        cos, sin = self.rope(context.next_positions(k))
        mask = self.block_mask(b, context.length, anchor.device, context.valid)
        record = {"pre_injection": None, "gates": [], "inject": inject}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, context.keys[i], context.values[i], mask)
            x = self.after_layer(i, x, anchor, output_embedding, record)
        final = self.norm(x)
        logits = final.float() @ output_embedding.float().T if compute_logits else None
        gates = torch.stack(record["gates"]) if record["gates"] else None
        return DraftOutput(logits=logits, hidden=final, pre_injection=record["pre_injection"],
                           gates=gates)

    def after_layer(self, layer, x, anchor, output_embedding, record):
        return x

    # ----- decoding ------------------------------------------------------------------------------
    def propose(self, out: DraftOutput, anchor: torch.Tensor, output_embedding: torch.Tensor,
                temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                generator: torch.Generator | None = None) -> Proposal:
        """DFlash's rule: every slot from its own distribution."""
        base = out.logits[:, 1:]                                           # [B, K-1, V]
        b, s, v = base.shape
        choice, q = sample(base.reshape(b * s, v), temperature, top_p, top_k, generator)
        return Proposal(tokens=choice.reshape(b, s), q=q.reshape(b, s, v))


# ----- DSpine --------------------------------------------------------------------------------
class AdjacentInjection(nn.Module):
    """R_l (readouts), W_l (writes), M (message), A (receiver_gate), B (predecessor_gate)
    and b (bias), under the reference's names."""

    def __init__(self, hidden: int, rank: int, message: int, num_layers: int):
        super().__init__()
        self.rank = rank
        self.readouts = nn.ModuleList([nn.Linear(hidden, rank, bias=False)
                                       for _ in range(num_layers)])
        self.writes = nn.ModuleList([nn.Linear(message, hidden, bias=False)
                                     for _ in range(num_layers)])
        self.message = nn.Linear(rank, message, bias=False)
        self.receiver_gate = nn.Linear(rank, message, bias=False)
        self.predecessor_gate = nn.Linear(rank, message, bias=False)
        self.bias = nn.Parameter(torch.zeros(message))

    def feature(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """phi_l(h) = sqrt(r) normalise(R_l h), [..., r] float32."""
        z = self.readouts[layer](h).float()
        return math.sqrt(self.rank) * z / z.norm(dim=-1, keepdim=True).clamp(min=1e-6)

    def write(self, layer: int, h: torch.Tensor, phi_h: torch.Tensor, pred: torch.Tensor):
        """The residual write into h [..., D] from its own feature and its predecessor's
        p [..., r]: (delta [..., D] in h's dtype, gate [..., m] float32)."""
        dtype = h.dtype
        gate = torch.sigmoid((self.receiver_gate(phi_h.to(dtype))
                              + self.predecessor_gate(pred.to(dtype))
                              + self.bias.to(dtype)).float())
        msg = self.message(pred.to(dtype)).float()
        h32 = h.float()
        rms = h32.pow(2).mean(-1, keepdim=True).sqrt()
        delta = rms * self.writes[layer]((gate * msg).to(dtype)).float()
        return delta.to(dtype), gate


class DSpineDraftModel(DFlashDraftModel):
    config_class = DSpineDraftConfig
    _keep_in_fp32_modules = list(TRANSFER_BUFFERS)

    def __init__(self, config: DSpineDraftConfig):
        super().__init__(config)
        d, r = config.hidden_size, config.transfer_rank
        self.injection = AdjacentInjection(d, r, config.message_size, config.num_hidden_layers)
        # The transfer space (fixed, float32): the state dict is the reference's, the
        # code table `transfer_codes` [V, r] and `transfer_ready` (False until a space is
        # loaded). A native checkpoint's whitening map is attached by `set_transfer_map`
        # (not in the state dict); codes then come from it and the target's lm_head rows.
        self.register_buffer("transfer_codes",
                             torch.zeros(config.vocab_size, r, dtype=torch.float32))
        self.register_buffer("transfer_ready", torch.tensor(False))
        self.post_init()

    def set_transfer_map(self, whiten: torch.Tensor, mean: torch.Tensor) -> None:
        """Use the whitening map whiten [D, r], mean [D] for the codes (a buffer outside
        the state dict, float32)."""
        for name, value in zip(MAP_BUFFERS, (whiten, mean)):
            self.register_buffer(name, value.detach().float().to(self.transfer_codes.device),
                                 persistent=False)

    @property
    def has_transfer_map(self) -> bool:
        """The codes come from the whitening map (else from the code table)."""
        return "transfer_whiten" in self._buffers

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, AdjacentInjection):  # a fresh DSpine computes what DFlash does
            for write in module.writes:
                nn.init.zeros_(write.weight)
            nn.init.zeros_(module.predecessor_gate.weight)
            nn.init.zeros_(module.bias)

    @property
    def causal_block(self) -> bool:
        return self.config.switch("causal_block")

    def codes(self, tokens: torch.Tensor, output_embedding: torch.Tensor) -> torch.Tensor:
        """sqrt(r) c_token [..., r] float32."""
        if not bool(self.transfer_ready):
            raise RuntimeError("the DSpine transfer space is not loaded (transfer_ready is "
                               "False): load a checkpoint that carries it")
        if self.has_transfer_map:
            rows = F.normalize(output_embedding[tokens].float(), dim=-1, eps=1e-12)
            z = (rows - self.transfer_mean.float()) @ self.transfer_whiten.float()
            c = F.normalize(z, dim=-1, eps=1e-12)
        else:
            c = self.transfer_codes.float()[tokens]
        return math.sqrt(self.config.transfer_rank) * c

    def after_layer(self, layer, x, anchor, output_embedding, record):
        record["pre_injection"] = x
        if not self.config.switch("injection"):
            return x
        if record.get("inject") is not None:
            x, gate = record["inject"](layer, x, self.codes(anchor, output_embedding))
            record["gates"].append(gate[:, 1:].mean())
            return x
        phi = self.injection.feature(layer, x)                             # [B, K, r]
        code = self.codes(anchor, output_embedding)[:, None]               # [B, 1, r]
        # p_1 = the anchor's code, p_i = phi(h_{i-1}) for i >= 2 (slot 0 gets no write).
        pred = torch.cat([code, code, phi[:, 1:-1]], 1)
        delta, gate = self.injection.write(layer, x, phi, pred)
        not_anchor = (torch.arange(x.shape[1], device=x.device) > 0)[None, :, None]
        record["gates"].append(gate[:, 1:].mean())
        return x + torch.where(not_anchor, delta, torch.zeros_like(delta))

    def transition_scores(self, pre_injection, predecessors, candidate_rows, output_embedding):
        """pre_injection [..., D]; predecessors [..., P] token ids; candidate_rows
        [..., C, D] -> scores [..., P, C] float32 of each candidate given each predecessor:
        the last layer's write redone with p = sqrt(r) c_a, then the final norm."""
        last = len(self.layers) - 1
        phi = self.injection.feature(last, pre_injection)[..., None, :]    # [..., 1, r]
        h = pre_injection[..., None, :]                                     # [..., 1, D]
        delta, _ = self.injection.write(last, h, phi, self.codes(predecessors, output_embedding))
        refined = self.norm(h + delta)                                      # [..., P, D]
        return torch.einsum("...pd,...cd->...pc", refined.float(), candidate_rows.float())

    def propose(self, out: DraftOutput, anchor: torch.Tensor, output_embedding: torch.Tensor,
                temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                generator: torch.Generator | None = None) -> Proposal:
        """The predecessor-conditioned head: top-C candidates per slot, a C x C table of
        transition scores per slot (one batched op), then a walk from the anchor; q_i is
        the softmax over slot i's candidates given the chosen predecessor."""
        if not self.config.switch("refinement_head"):
            return super().propose(out, anchor, output_embedding, temperature, top_p, top_k,
                                   generator)
        base = out.logits[:, 1:]                                            # [B, K-1, V]
        b, s, vocab = base.shape
        c = min(self.config.top_k, vocab)
        candidates = torch.topk(base, c, dim=-1).indices                   # [B, K-1, C]
        preds = torch.cat([anchor[:, None, None].expand(b, 1, c), candidates[:, :-1]], 1)
        rows = output_embedding[candidates]                                 # [B, K-1, C, D]
        table = self.transition_scores(out.pre_injection[:, 1:], preds, rows, output_embedding)
        index = torch.zeros(b, dtype=torch.long, device=base.device)        # the anchor's row
        tokens, qs = [], []
        for i in range(s):
            given = table[torch.arange(b), i, index]                        # [B, C]
            index, probs = sample(given, temperature, top_p, top_k, generator)
            tokens.append(candidates[torch.arange(b), i, index])
            qs.append(torch.zeros(b, vocab, device=base.device).scatter(
                1, candidates[:, i], probs))
        return Proposal(tokens=torch.stack(tokens, 1), q=torch.stack(qs, 1),
                        candidates=candidates, table=table)


# ----- loading with strict key checks --------------------------------------------------------
ARCHITECTURES = {"DFlashDraftModel": (DFlashDraftConfig, DFlashDraftModel),
                 "DSpineDraftModel": (DSpineDraftConfig, DSpineDraftModel)}


def load_drafter(folder, dtype: torch.dtype = torch.float32) -> DFlashDraftModel:
    """Build the drafter a checkpoint folder describes and fill it, refusing missing,
    unexpected and misshapen tensors. A DSpine folder needs its transfer space: the code
    table (`transfer_codes`; the reference layout) or the whitening map (`transfer_whiten`,
    `transfer_mean`; the native layout, used when present); `transfer_ready`, where
    present, must be True."""
    from safetensors.torch import load_file

    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    arch = (raw.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"{folder}: not a DFlash/DSpine drafter (architectures={arch!r})")
    config_cls, model_cls = ARCHITECTURES[arch]
    config = config_cls.from_dict({k: v for k, v in raw.items() if k != "auto_map"})
    model = model_cls(config)
    tensors = load_file(str(folder / "model.safetensors"))
    expected = dict(model.state_dict())
    optional, transfer_map = set(), None
    if arch == "DSpineDraftModel":
        optional = {"transfer_ready"}
        if set(MAP_BUFFERS) <= set(tensors):
            transfer_map = [tensors.pop(name) for name in MAP_BUFFERS]
            d, r = config.hidden_size, config.transfer_rank
            expected.update(transfer_whiten=torch.empty(d, r), transfer_mean=torch.empty(d))
            optional.add("transfer_codes")  # older exports carried both: the map is used
        elif "transfer_codes" not in tensors:
            raise ValueError(f"{folder}: a DSpine checkpoint needs transfer_whiten and "
                             "transfer_mean, or transfer_codes")
        if "transfer_ready" in tensors and not bool(tensors["transfer_ready"]):
            raise ValueError(f"{folder}: transfer_ready is False: the transfer space was "
                             "never built, so the codes and readouts are not usable")
    present = set(tensors) | ({*MAP_BUFFERS} if transfer_map is not None else set())
    missing = sorted(set(expected) - present - optional)
    unexpected = sorted(present - set(expected))
    if missing or unexpected:
        raise ValueError(f"{folder}: weights and config disagree. Missing: {missing[:6]}; "
                         f"unexpected: {unexpected[:6]}")
    named = dict(tensors, **dict(zip(MAP_BUFFERS, transfer_map or ())))
    for name, value in named.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise ValueError(f"{folder}: tensor {name} has shape {tuple(value.shape)} but the "
                             f"config implies {tuple(expected[name].shape)}")
    model.load_state_dict(tensors, strict=False)
    if arch == "DSpineDraftModel":
        model.transfer_ready.fill_(True)
        if transfer_map is not None:
            model.set_transfer_map(*transfer_map)
    model.to(dtype)
    for name in TRANSFER_BUFFERS if arch == "DSpineDraftModel" else ():
        if name in model._buffers:
            setattr(model, name, model._buffers[name].float())
    return model.eval()
