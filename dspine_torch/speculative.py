"""Speculative decoding in PyTorch over a transformers causal LM (Qwen3, Llama, ...).

One row at a time. Between steps the target's KV cache and the drafter's context hold
positions 0 .. L-1 and the anchor (the last emitted token) sits at position L. A step:
  draft   one drafter pass over [anchor, MASK...] -> K-1 draft tokens and their q
  verify  one target pass over [anchor, drafts] -> p at every position, target features
  accept  keep d_i with probability min(1, p_i(d_i) / q_i(d_i)) (at T = 0: while d_i is
          the target's argmax); the target then samples from norm(max(0, p - q)) at the
          first rejection, or from p after all K-1 (the bonus); the cache is cropped to
          L + n + 1 and the drafter context gains the features of positions L .. L + n.

Shape legend: K block size, V vocab, F fused feature width.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from dspine_torch.kernels import acceptance, dspine_proposal, gated_injection
from dspine_torch.kernels.common import inverse_cdf
from dspine_torch.modeling_dspine import DFlashDraftModel, DSpineDraftModel, warp_logits


class TargetRunner:
    """A transformers causal LM with a KV cache it can roll back, returning the hidden
    states after the drafter's target layers (forward hooks: HF's `hidden_states` tuple
    applies the final norm to its last entry)."""

    def __init__(self, model, layer_ids):
        self.model = model.eval()
        self.layer_ids = list(layer_ids)
        self.cache = None
        self._captured = {}
        layers = model.model.layers
        bad = [i for i in self.layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"drafter reads target layers {bad}; the target has {len(layers)}")
        import inspect

        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._hooks = [layers[i].register_forward_hook(self._hook(i)) for i in set(self.layer_ids)]

    def _hook(self, i):
        def capture(module, args, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output
        return capture

    def close(self):
        for hook in self._hooks:
            hook.remove()

    @property
    def length(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor):
        """tokens [1, T] at positions length .. length + T - 1 -> (logits [T, V] float32,
        features [1, T, F])."""
        from transformers import DynamicCache

        if self.cache is None:
            self.cache = DynamicCache(config=self.model.config)
        # The cache object is updated in place (newer transformers call the argument `cache`).
        out = self.model(input_ids=tokens, use_cache=True, **{self._cache_arg: self.cache})
        features = torch.cat([self._captured[i] for i in self.layer_ids], -1)
        return out.logits[0].float(), features

    def rollback(self, length: int) -> None:
        """Keep positions 0 .. length-1 (a negative crop removes that many tokens, in
        every transformers release that has DynamicCache.crop)."""
        remove = self.length - length
        if remove > 0:
            self.cache.crop(-remove)

    def input_embedding(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def output_embedding(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's distribution p [..., V]: one-hot argmax at T = 0."""
        if self.temperature <= 0:
            return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return torch.softmax(warp_logits(logits, self.temperature, self.top_p, self.top_k), -1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); p itself where that is all zero."""
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def verify(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
           generator: torch.Generator | None = None) -> tuple[int, int]:
    """draft_tokens [K-1]; q [K-1, V]; p [K, V] -> (drafts kept, the target's next token)."""
    n = draft_tokens.shape[0]
    idx = torch.arange(n)
    p_draft, q_draft = p[idx, draft_tokens], q[idx, draft_tokens]
    u = torch.rand(n, generator=generator)
    kept = (u * q_draft < p_draft).int()
    accepted = int(torch.cumprod(kept, 0).sum())
    if accepted == n:
        dist = p[n]
    else:
        dist = residual(p[accepted], q[accepted])
    token = int(torch.multinomial(dist, 1, generator=generator)[0])
    return accepted, token


def chain_head(drafter: DSpineDraftModel) -> dspine_proposal.ChainHead:
    """The tensors of a DSpine drafter's decoding head, for the proposal kernels."""
    inj, last = drafter.injection, len(drafter.layers) - 1
    has_map = bool(drafter.transfer_whiten.any())
    return dspine_proposal.ChainHead(
        readout=inj.readouts[last].weight, receiver_gate=inj.receiver_gate.weight,
        predecessor_gate=inj.predecessor_gate.weight, bias=inj.bias,
        message=inj.message.weight, write=inj.writes[last].weight,
        norm_weight=drafter.norm.weight, eps=drafter.norm.eps,
        whiten=drafter.transfer_whiten if has_map else None,
        mean=drafter.transfer_mean if has_map else None,
        code_table=None if has_map else drafter.transfer_codes)


def injector(drafter: DSpineDraftModel, implementation: str):
    """The drafter's per-layer write through the gated-injection kernel."""
    inj = drafter.injection

    def run(layer: int, h: torch.Tensor, anchor_code: torch.Tensor):
        return gated_injection.inject(
            h, anchor_code, inj.readouts[layer].weight, inj.receiver_gate.weight,
            inj.predecessor_gate.weight, inj.bias, inj.message.weight,
            inj.writes[layer].weight, implementation=implementation)
    return run


def uses_chain(drafter: DFlashDraftModel) -> bool:
    return isinstance(drafter, DSpineDraftModel) and drafter.config.switch("refinement_head")


@dataclasses.dataclass
class Draft:
    tokens: torch.Tensor           # [B, S]
    q_ids: torch.Tensor | None     # [B, S, C] the support of sparse q; None: q is dense
    q_probs: torch.Tensor          # [B, S, C] or [B, S, V]


def draft_block(drafter: DFlashDraftModel, anchor: torch.Tensor, context, e_in, e_out,
                sampling: "Sampling", generator: torch.Generator | None,
                implementation: str = "torch") -> Draft:
    """One drafter pass and its proposal through the kernels (`implementation` "torch":
    their PyTorch references; "triton": the Triton kernels).

    DSpine: top-C from the final hidden states and the lm_head (no [B, K, V] logits), the
    transition table, the walk; q sparse over the candidates. DFlash at T = 0: top-1 the
    same way. DFlash at T > 0 needs every slot's full softmax, so its logits come from
    torch's matmul and its draw from the warped softmax (dense q)."""
    s = drafter.block_size - 1
    b = anchor.shape[0]
    temperature = sampling.temperature
    uniforms = None
    if temperature > 0:
        uniforms = torch.rand(b, s, generator=generator).to(anchor.device)
    chain = uses_chain(drafter)
    inject = None
    if isinstance(drafter, DSpineDraftModel) and drafter.config.switch("injection"):
        inject = injector(drafter, implementation)
    need_logits = not chain and temperature > 0
    out = drafter(anchor, context, e_in, e_out, compute_logits=need_logits, inject=inject)
    hidden = out.hidden[:, 1:]                                            # [B, S, D]
    if chain:
        proposal = dspine_proposal.propose_chain(
            hidden, out.pre_injection[:, 1:], anchor, e_out, chain_head(drafter),
            drafter.config.top_k, temperature, sampling.top_p, sampling.top_k, uniforms,
            implementation=implementation)
        return Draft(tokens=proposal.tokens, q_ids=proposal.candidates, q_probs=proposal.q)
    if temperature <= 0:
        _, ids = dspine_proposal.vocab_topk(hidden.reshape(b * s, -1), e_out, 1,
                                            implementation=implementation)
        tokens = ids.reshape(b, s)
        return Draft(tokens=tokens, q_ids=tokens[..., None],
                     q_probs=torch.ones(b, s, 1, device=anchor.device))
    probs = torch.softmax(warp_logits(out.logits[:, 1:], temperature, sampling.top_p,
                                      sampling.top_k), -1)
    tokens = inverse_cdf(probs.reshape(b * s, -1), uniforms.reshape(-1)).reshape(b, s)
    return Draft(tokens=tokens, q_ids=None, q_probs=probs)


@dataclasses.dataclass
class Generation:
    tokens: list[int]
    accept_lengths: list[int]   # tokens emitted per target verify pass


@torch.no_grad()
def generate(target_model, drafter: DFlashDraftModel, prompt: list[int], *,
             max_new_tokens: int = 64, sampling: Sampling = Sampling(), seed: int = 0,
             eos_token_ids=(), ignore_eos: bool = False,
             implementation: str = "torch") -> Generation:
    """Speculative decoding of one prompt; at T = 0 the tokens equal the target's own
    greedy decoding. `implementation` picks the kernels of the proposal, the injection
    and the verification rule: "torch" (their PyTorch references) or "triton". Random
    numbers come from a CPU generator seeded with `seed`, whatever the device."""
    generator = torch.Generator().manual_seed(seed)
    target = TargetRunner(target_model, drafter.target_layer_ids)
    device = target.input_embedding().device
    try:
        e_in, e_out = target.input_embedding(), target.output_embedding()
        logits, features = target(torch.tensor([prompt], device=device))
        anchor = _sample_one(logits[-1], sampling, generator)
        context = drafter.extend_context(drafter.new_context(1), features)
        tokens, accept_lengths = [anchor], []
        eos = set(eos_token_ids) if not ignore_eos else set()
        while len(tokens) < max_new_tokens and not (tokens[-1] in eos):
            start = target.length
            anchor_t = torch.tensor([anchor], device=device)
            draft = draft_block(drafter, anchor_t, context, e_in, e_out, sampling, generator,
                                implementation)
            block = torch.cat([anchor_t, draft.tokens[0]])[None]
            logits, features = target(block)
            u_accept = u_next = None
            if sampling.temperature > 0:
                u_accept = torch.rand(1, draft.tokens.shape[1], generator=generator).to(device)
                u_next = torch.rand(1, generator=generator).to(device)
            n, nxt = acceptance.accept(logits[None], draft.tokens, draft.q_ids, draft.q_probs,
                                       sampling.temperature, sampling.top_p, sampling.top_k,
                                       u_accept, u_next, implementation=implementation)
            n, nxt = int(n[0]), int(nxt[0])
            target.rollback(start + n + 1)
            context = drafter.extend_context(context, features[:, :n + 1])
            emitted = draft.tokens[0, :n].tolist() + [nxt]
            for i, t in enumerate(emitted):
                if t in eos:
                    emitted = emitted[:i + 1]
                    break
            emitted = emitted[:max_new_tokens - len(tokens)]
            tokens += emitted
            accept_lengths.append(len(emitted))
            anchor = nxt
        return Generation(tokens=tokens, accept_lengths=accept_lengths)
    finally:
        target.close()


def _sample_one(logits: torch.Tensor, sampling: Sampling, generator) -> int:
    if sampling.temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(warp_logits(logits, sampling.temperature, sampling.top_p,
                                      sampling.top_k), -1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator)[0])  # CPU generator
