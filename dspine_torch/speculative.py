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

from dspine_torch.modeling_dspine import DFlashDraftModel, Proposal, warp_logits


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


@dataclasses.dataclass
class Generation:
    tokens: list[int]
    accept_lengths: list[int]   # tokens emitted per target verify pass


@torch.no_grad()
def generate(target_model, drafter: DFlashDraftModel, prompt: list[int], *,
             max_new_tokens: int = 64, sampling: Sampling = Sampling(), seed: int = 0,
             eos_token_ids=(), ignore_eos: bool = False) -> Generation:
    """Speculative decoding of one prompt; at T = 0 the tokens equal the target's own
    greedy decoding."""
    generator = torch.Generator().manual_seed(seed)
    target = TargetRunner(target_model, drafter.target_layer_ids)
    try:
        e_in, e_out = target.input_embedding(), target.output_embedding()
        logits, features = target(torch.tensor([prompt]))
        anchor = _sample_one(logits[-1], sampling, generator)
        context = drafter.extend_context(drafter.new_context(1), features)
        tokens, accept_lengths = [anchor], []
        eos = set(eos_token_ids) if not ignore_eos else set()
        while len(tokens) < max_new_tokens and not (tokens[-1] in eos):
            start = target.length
            anchor_t = torch.tensor([anchor])
            out = drafter(anchor_t, context, e_in, e_out)
            proposal: Proposal = drafter.propose(out, anchor_t, e_out, sampling.temperature,
                                                 sampling.top_p, sampling.top_k, generator)
            block = torch.cat([anchor_t, proposal.tokens[0]])[None]
            logits, features = target(block)
            p = sampling.probabilities(logits)
            n, nxt = verify(proposal.tokens[0], proposal.q[0], p, generator)
            target.rollback(start + n + 1)
            context = drafter.extend_context(context, features[:, :n + 1])
            emitted = proposal.tokens[0, :n].tolist() + [nxt]
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
    return int(torch.multinomial(probs, 1, generator=generator)[0])
