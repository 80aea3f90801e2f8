"""Speculative decoding in PyTorch over a transformers causal LM (Qwen3, Llama, ...).

B rows at once, each at its own length. Between steps row b's target KV cache and
drafter context hold its positions 0 .. L_b - 1 and its anchor (the last emitted token)
sits at position L_b. A step, for every row:
  draft   one drafter pass over [anchor, MASK...] -> K-1 draft tokens and their q
  verify  one target pass over [anchor, drafts] -> p at every position, target features
  accept  keep d_i with probability min(1, p_i(d_i) / q_i(d_i)) (at T = 0: while d_i is
          the target's argmax); the target then samples from norm(max(0, p - q)) at the
          first rejection, or from p after all K-1 (the bonus); row b keeps L_b + n_b + 1
          positions and its drafter context gains the features of L_b .. L_b + n_b.

Ragged rows. transformers' DynamicCache crops every row to one length, but rows accept
different counts. So the cache stays a padded batch: each verify appends K columns to
every row, a row's rejected columns become holes that its attention mask hides from then
on, and RoPE positions come from per-row lengths, never from column indices. Columns
past every row's last kept one are cropped, so the cache grows by the longest row's
accepted length per step (plus the holes of the others). The drafter context works the
same way (`DraftContext.valid`, `.lengths`). A static cache with per-row lengths would
avoid the holes but needs a per-row write offset that transformers' caches do not have.
Finished rows leave the batch (`DynamicCache.batch_select_indices`). With one row there
are never holes and no mask is passed: the batch-of-one path is the plain one.

Randomness is per row: row i draws from its own CPU generator (seed + i, or seeds[i]),
the same numbers in the same order whatever else is in the batch.

Shape legend: B batch, K block size, S = K - 1 drafted slots, T new columns, V vocab,
F fused feature width.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.nn.functional as F

from dspine_torch.kernels import acceptance, dspine_proposal, gated_injection
from dspine_torch.kernels.common import inverse_cdf
from dspine_torch.modeling_dspine import DFlashDraftModel, DSpineDraftModel, warp_logits


class TargetRunner:
    """A transformers causal LM over a padded batch of ragged rows: a KV cache whose
    rejected columns become masked holes, per-row RoPE positions, and the hidden states
    after the drafter's target layers (forward hooks: HF's `hidden_states` tuple applies
    the final norm to its last entry)."""

    def __init__(self, model, layer_ids):
        self.model = model.eval()
        self.layer_ids = list(layer_ids)
        self.cache = None
        self.mask = None        # [B, columns] bool; None: every column of every row valid
        self.lengths = None     # [B] valid columns per row (the next position)
        self._last = 0          # columns the last call appended
        self._captured = {}
        layers = model.model.layers
        bad = [i for i in self.layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"drafter reads target layers {bad}; the target has {len(layers)}")
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
        """Columns in the cache (every row's length when there are no holes)."""
        return 0 if self.cache is None else self.cache.get_seq_length()

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, valid: torch.Tensor | None = None):
        """Append tokens [B, T] as T new columns at each row's next positions; `valid`
        [B, T] bool (a prefix per row: right-padded prompts) marks the real ones.
        Returns (logits [B, T, V] float32, features [B, T, F])."""
        from transformers import DynamicCache

        b, t = tokens.shape
        device = tokens.device
        if self.cache is None:
            self.cache = DynamicCache(config=self.model.config)
            self.lengths = torch.zeros(b, dtype=torch.long, device=device)
        positions = self.lengths[:, None] + torch.arange(t, device=device)
        if valid is not None and self.mask is None:
            self.mask = torch.ones(b, self.length, dtype=torch.bool, device=device)
        kwargs = {}
        if self.mask is not None:
            new = valid if valid is not None else torch.ones(b, t, dtype=torch.bool,
                                                             device=device)
            self.mask = torch.cat([self.mask, new], 1)
            kwargs["attention_mask"] = self.mask.long()
        # The cache object is updated in place (newer transformers call the argument `cache`).
        out = self.model(input_ids=tokens, position_ids=positions, use_cache=True,
                         **{self._cache_arg: self.cache}, **kwargs)
        self.lengths = self.lengths + (t if valid is None else valid.sum(1))
        self._last = t
        features = torch.cat([self._captured[i] for i in self.layer_ids], -1)
        return out.logits.float(), features

    def keep(self, counts: torch.Tensor) -> None:
        """Of the last call's T columns, row b keeps its first counts[b]; the others
        become holes, and columns no row keeps are cropped."""
        counts = counts.to(self.lengths.device)
        t, total = self._last, self.length
        start = total - t
        self.lengths = self.lengths - t + counts
        end = start + int(counts.max())
        if self.mask is None and bool((counts == counts[0]).all()):
            self._crop_to(end)                    # no holes: the plain path
            return
        if self.mask is None:
            self.mask = torch.ones(len(counts), total, dtype=torch.bool,
                                   device=self.lengths.device)
        kept = torch.arange(t, device=counts.device)[None] < counts[:, None]
        self.mask = torch.cat([self.mask[:, :start], kept], 1)[:, :end]
        self._crop_to(end)

    def _crop_to(self, columns: int) -> None:
        """Keep the first `columns` columns (a negative crop removes that many, in every
        transformers release that has DynamicCache.crop; newer ones refuse a positive one)."""
        remove = self.length - columns
        if remove > 0:
            self.cache.crop(-remove)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the given rows (finished rows leave the batch)."""
        self.cache.batch_select_indices(rows)
        self.lengths = self.lengths[rows]
        if self.mask is not None:
            self.mask = self.mask[rows]

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
    has_map = drafter.has_transfer_map
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
                sampling: "Sampling", uniforms: torch.Tensor | None = None,
                implementation: str = "torch") -> Draft:
    """One drafter pass and its proposal through the kernels (`implementation` "torch":
    their PyTorch references; "triton": the Triton kernels); `uniforms` [B, S] are the
    draws at T > 0.

    DSpine: top-C from the final hidden states and the lm_head (no [B, K, V] logits), the
    transition table, the walk; q sparse over the candidates. DFlash at T = 0: top-1 the
    same way. DFlash at T > 0 needs every slot's full softmax, so its logits come from
    torch's matmul and its draw from the warped softmax (dense q)."""
    s = drafter.block_size - 1
    b = anchor.shape[0]
    temperature = sampling.temperature
    if temperature > 0 and uniforms is None:
        raise ValueError("draft_block at temperature > 0 needs uniforms [B, S]")
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


class _RowDraws:
    """Per-row uniforms from per-row CPU generators (a row's numbers do not depend on
    the other rows), moved to the device."""

    def __init__(self, seeds, device):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.device = device

    def __call__(self, count: int) -> torch.Tensor:
        """[rows, count]."""
        return torch.stack([torch.rand(count, generator=g) for g in self.generators]
                           ).to(self.device)

    def select(self, rows: list[int]) -> None:
        self.generators = [self.generators[i] for i in rows]


@torch.no_grad()
def generate_batch(target_model, drafter: DFlashDraftModel, prompts: list[list[int]], *,
                   max_new_tokens: int = 64, sampling: Sampling = Sampling(), seed: int = 0,
                   seeds: list[int] | None = None, eos_token_ids=(), ignore_eos: bool = False,
                   implementation: str = "torch") -> list[Generation]:
    """Speculative decoding of B prompts of any lengths in one padded batch (see the
    module docstring); at T = 0 each row's tokens equal the target's own greedy
    decoding. `implementation` picks the kernels of the proposal, the injection and the
    verification rule: "torch" (their PyTorch references) or "triton". Row i's random
    numbers come from a CPU generator seeded with seeds[i] (default seed + i), whatever
    the device and the rest of the batch."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_batch needs at least one prompt, none of them empty")
    b = len(prompts)
    seeds = list(seeds) if seeds is not None else [seed + i for i in range(b)]
    if len(seeds) != b:
        raise ValueError(f"{len(seeds)} seeds for {b} prompts")
    target = TargetRunner(target_model, drafter.target_layer_ids)
    device = target.input_embedding().device
    draws = _RowDraws(seeds, device)
    sampled = sampling.temperature > 0
    eos = set() if ignore_eos else set(eos_token_ids)
    try:
        e_in, e_out = target.input_embedding(), target.output_embedding()
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        width = int(lengths.max())
        padded = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=device)
        valid = None
        if b > 1 and bool((lengths < width).any()):
            valid = torch.arange(width, device=device)[None] < lengths[:, None]
        logits, features = target(padded, valid)                # right-padded prompts
        last = logits[torch.arange(b, device=device), lengths - 1]          # [B, V]
        anchor = _first_tokens(last, sampling, draws(1)[:, 0] if sampled else None)
        context = drafter.extend_context(drafter.new_context(b), features, valid)
        results = [Generation(tokens=[int(a)], accept_lengths=[]) for a in anchor.tolist()]
        live = list(range(b))          # the batch row of each generation still running
        k = drafter.block_size
        while True:
            running = [i for i, row in enumerate(live) if not _finished(
                results[row], max_new_tokens, eos)]
            if not running:
                break
            if len(running) < len(live):
                rows = torch.tensor(running, device=device)
                target.select(rows)
                context = context.select(rows)
                anchor = anchor[rows]
                draws.select(running)
                live = [live[i] for i in running]
            draft = draft_block(drafter, anchor, context, e_in, e_out, sampling,
                                draws(k - 1) if sampled else None, implementation)
            block = torch.cat([anchor[:, None], draft.tokens], 1)         # [B, K]
            logits, features = target(block)
            u_accept = u_next = None
            if sampled:
                u = draws(k)
                u_accept, u_next = u[:, :-1], u[:, -1]
            n, nxt = acceptance.accept(logits, draft.tokens, draft.q_ids, draft.q_probs,
                                       sampling.temperature, sampling.top_p, sampling.top_k,
                                       u_accept, u_next, implementation=implementation)
            target.keep(n + 1)
            kept = torch.arange(k, device=device)[None] < (n + 1)[:, None]
            context = drafter.extend_context(context, features, kept).trim()
            for row, drafts, count, token in zip(live, draft.tokens.tolist(), n.tolist(),
                                                 nxt.tolist()):
                _emit(results[row], drafts[:count] + [token], max_new_tokens, eos)
            anchor = nxt
        return results
    finally:
        target.close()


def generate(target_model, drafter: DFlashDraftModel, prompt: list[int], *,
             max_new_tokens: int = 64, sampling: Sampling = Sampling(), seed: int = 0,
             eos_token_ids=(), ignore_eos: bool = False,
             implementation: str = "torch") -> Generation:
    """Speculative decoding of one prompt (a batch of one, see `generate_batch`)."""
    [result] = generate_batch(target_model, drafter, [prompt], max_new_tokens=max_new_tokens,
                              sampling=sampling, seeds=[seed], eos_token_ids=eos_token_ids,
                              ignore_eos=ignore_eos, implementation=implementation)
    return result


def _finished(gen: Generation, max_new_tokens: int, eos: set) -> bool:
    return len(gen.tokens) >= max_new_tokens or gen.tokens[-1] in eos


def _emit(gen: Generation, emitted: list[int], max_new_tokens: int, eos: set) -> None:
    """Append one verify pass's tokens, cut after an EOS and at the budget."""
    for i, t in enumerate(emitted):
        if t in eos:
            emitted = emitted[:i + 1]
            break
    emitted = emitted[:max_new_tokens - len(gen.tokens)]
    gen.tokens += emitted
    gen.accept_lengths.append(len(emitted))


def _first_tokens(logits: torch.Tensor, sampling: Sampling,
                  u: torch.Tensor | None) -> torch.Tensor:
    """logits [B, V] -> [B]: the argmax at T = 0, else the inverse-CDF draw at u [B]."""
    if sampling.temperature <= 0:
        return logits.argmax(-1)
    return inverse_cdf(sampling.probabilities(logits), u)
