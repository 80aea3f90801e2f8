"""Drafter losses and metrics (design doc 1 and 2.3-2.4). Either loss fits either drafter.

Per supervised slot k (k >= 1), weight w_k = exp(-(k - 1) / gamma):
  backbone     "ce": CE(label)   |   "ce+l1": ce_w * CE + (1 - ce_w) * |softmax - p_target|_1
  refinement   (DSpine head) top-k candidates of the backbone logits scored with the TRUE
               predecessor; ce_w * CE (label among them) + (1 - ce_w) * L1 to p_target
               renormalised over them (skipped below the mass threshold)
  alignment    sum_l (1 - cos(phi_l(h), c_label)) * beta * warm-up * mean backbone CE (detached)
Total = sum_slots w * (backbone + refinement + alignment) / sum_slots w.

Shape legend: B batch, n blocks, K block size, V vocab, C candidates, L draft layers.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from dspine_jax.drafters.config import DrafterConfig
from dspine_jax.drafters.model import BlockDrafter, DraftOutput
from dspine_jax.errors import ConfigError
from dspine_jax.sampling import top_k_indices
from pallas_kernels.lm_head_stats import lm_head_stats

BACKBONE_LOSSES = ("ce", "ce+l1")
CANDIDATE_SOURCES = ("auto", "logits", "kernel")
LOGITS_PATHS = ("auto", "dense", "fused")
# Below about this width the [R, V] logits are bandwidth-bound (2D FLOPs per 4-byte logit
# written and read again), so computing them tile by tile wins; above it cuBLAS's matmul
# beats the kernel's. On the H200: D 576 (SmolLM2), the step 1.04x with 34% less memory;
# D 4,096 (Qwen3-8B), the op 1.3x slower (docs/benchmarks.md, "Drafter training throughput").
FUSED_MAX_HIDDEN = 1024


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """What training optimises: the loss terms and the teacher-replacement curriculum that
    shapes the drafter's inputs. The one declaration of these fields: the TOML `[loss]`
    section maps onto it field by field. `None` means "the drafter's own" and is filled in
    by `resolve` (DFlash: CE only; DSpine: the design's CE+L1, refinement and alignment)."""

    gamma: float | None = None         # slot decay; None: 7 for K=16, 5 for 10, 4 for 8
    backbone: str | None = None        # [switch] "ce" (DFlash) or "ce+l1" (DSpine)
    ce_weight: float = 0.1             # ce_weight * CE + (1 - ce_weight) * L1
    refinement: bool | None = None     # decoding-head loss; None: when the head is on
    top_k: int | None = None           # refinement candidates; None: the drafter's top_k
    # where the refinement's candidates come from: "logits", a top-k of the [B, n, K, V]
    # logits the loss already holds; "kernel", `vocab_top_k` of the final hidden states
    # against the output embedding (the decode pass's op: on a GPU a Pallas kernel that
    # recomputes the products tile by tile and never reads the logits; 1.23x the DSpine
    # step on an H200); "auto": "kernel" on a GPU, "logits" elsewhere
    candidates: str = "auto"
    # how the vocabulary-sized work runs: "dense" builds the [B, n, K, V] logits (the
    # drafter's, and the target's for the refinement) and differentiates them by autodiff;
    # "fused" takes the CE, the label's rank and the target's log-normaliser straight from
    # the hidden states with `pallas_kernels.lm_head_stats` (a kernel on a GPU or TPU,
    # vocabulary chunks elsewhere; no [B, n, K, V] tensor), for a CE backbone with the
    # refinement's candidates from the kernel (on a GPU the same kernel, in the same pass
    # over the lm_head as the stats); "auto": "fused" on a GPU for a CE backbone
    # and a drafter at most FUSED_MAX_HIDDEN wide, "dense" otherwise (`auto_logits`)
    logits: str = "auto"
    candidate_mass_threshold: float = 1e-4
    alignment: bool = True             # [switch] layer-wise output-embedding supervision
    alignment_weight: float = 0.5      # beta (DSpine only)
    alignment_warmup_steps: int = 150
    teacher_replacement: bool = True   # [switch] true predecessors' codes, early layers
    replacement_layers: int = 3
    replacement_probability: float = 0.5
    replacement_hold_ratio: float = 1 / 6
    replacement_end_ratio: float = 1 / 3

    def __post_init__(self):
        if self.backbone is not None and self.backbone not in BACKBONE_LOSSES:
            raise ConfigError(f"loss.backbone must be one of {BACKBONE_LOSSES}, "
                              f"got {self.backbone!r}")
        if self.candidates not in CANDIDATE_SOURCES:
            raise ConfigError(f"loss.candidates must be one of {CANDIDATE_SOURCES}, "
                              f"got {self.candidates!r}")
        if self.logits not in LOGITS_PATHS:
            raise ConfigError(f"loss.logits must be one of {LOGITS_PATHS}, got {self.logits!r}")
        if self.logits == "fused" and self.candidates == "logits":
            raise ConfigError("loss.logits = 'fused' builds no logits to take the candidates "
                              "from: use loss.candidates = 'kernel' (or 'auto')")
        if self.logits == "fused" and self.backbone == "ce+l1":
            raise ConfigError("loss.logits = 'fused' computes the CE backbone only; the L1 term "
                              "of backbone 'ce+l1' needs loss.logits = 'dense'")
        if self.gamma is not None and not self.gamma > 0:
            raise ConfigError(f"loss.gamma must be positive, got {self.gamma!r}")
        for name in ("ce_weight", "replacement_probability", "replacement_hold_ratio",
                     "replacement_end_ratio"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"loss.{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.replacement_hold_ratio > self.replacement_end_ratio:
            raise ConfigError("loss.replacement_hold_ratio must not exceed "
                              "loss.replacement_end_ratio")
        for name in ("alignment_warmup_steps", "top_k"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"loss.{name} must be positive, got {value!r}")
        if self.alignment_weight < 0 or self.replacement_layers < 0:
            raise ConfigError("loss.alignment_weight and loss.replacement_layers must not be "
                              "negative")

    def resolve(self, config: DrafterConfig) -> "LossConfig":
        """Every `None` filled in for this drafter; switches a DFlash cannot use turned off
        (it has no transfer space to align to or to replace codes in)."""
        spine = config.dspine
        backbone = self.backbone or ("ce" if spine is None else "ce+l1")
        if self.logits == "fused" and backbone == "ce+l1":
            raise ConfigError("loss.logits = 'fused' computes the CE backbone only; this "
                              "drafter's default backbone is 'ce+l1': set loss.backbone = "
                              "'ce' or loss.logits = 'dense'")
        return dataclasses.replace(
            self,
            gamma=self.gamma or {16: 7.0, 10: 5.0, 8: 4.0}.get(config.block_size, 7.0),
            backbone=backbone,
            logits=(auto_logits(backbone, self.candidates, config.hidden_size)
                    if self.logits == "auto" else self.logits),
            refinement=(spine is not None and spine.refinement_head
                        if self.refinement is None else self.refinement),
            top_k=self.top_k or (16 if spine is None else spine.top_k),
            alignment=self.alignment and spine is not None,
            teacher_replacement=self.teacher_replacement and spine is not None)

    @property
    def resolved(self) -> bool:
        return (None not in (self.gamma, self.backbone, self.refinement, self.top_k)
                and self.logits != "auto")

    @property
    def reads_p_target(self) -> bool:
        """Whether the loss reads the target's distribution at the slots (a CE+L1 backbone or
        the refinement), so a training step runs the target to its final hidden states."""
        return self.backbone == "ce+l1" or bool(self.refinement)

    @property
    def fused_logits(self) -> bool:
        """Whether the loss takes its vocabulary statistics from `lm_head_stats`."""
        if self.logits == "auto":
            raise ValueError("loss.logits 'auto' is decided by resolve(drafter.config)")
        return self.logits == "fused"


def auto_logits(backbone: str, candidates: str, hidden_size: int,
                backend: str | None = None) -> str:
    """What loss.logits = "auto" means for this loss and drafter on this backend: "fused"
    on a GPU, where it is timed faster, if the loss allows it (a CE backbone, candidates
    not taken from the logits) and the drafter is narrow enough (FUSED_MAX_HIDDEN);
    "dense" otherwise: on a TPU "fused" is not yet timed, and a CPU keeps the plain path
    that the references check against."""
    backend = backend or jax.default_backend()
    fits = backbone == "ce" and candidates != "logits" and hidden_size <= FUSED_MAX_HIDDEN
    return "fused" if backend == "gpu" and fits else "dense"


def slot_weights(block_size: int, gamma: float) -> jax.Array:
    """[K]: 0 for the anchor slot, exp(-(k-1)/gamma) for k >= 1."""
    k = jnp.arange(block_size, dtype=jnp.float32)
    return jnp.where(k >= 1, jnp.exp(-(k - 1) / gamma), 0.0)


def teacher_replacement_probability(progress, hold: float, end: float, start_p: float):
    """start_p until `hold` of training, then linearly to 0 at `end`."""
    progress = jnp.asarray(progress, jnp.float32)
    ramp = jnp.clip((end - progress) / max(end - hold, 1e-9), 0.0, 1.0)
    return start_p * jnp.where(progress <= hold, 1.0, ramp)


def alignment_scale(step, beta: float, warmup_steps: int):
    return beta * jnp.minimum(1.0, jnp.asarray(step, jnp.float32) / max(warmup_steps, 1))


def drafter_loss(config: LossConfig, drafter: BlockDrafter, out: DraftOutput, labels,
                 supervised, *, target_logits=None, target_hidden=None, teacher_tokens=None,
                 output_embedding=None, step=0, all_sum=None):
    """(loss, metrics). labels/supervised [B, n, K]; target_logits [B, n, K, V] (needed by
    L1 terms and, on the dense path, the refinement) or, on the fused path
    (`config.fused_logits`), target_hidden [B, n, K, D] the target's final hidden states
    at the slots (the refinement's p_target); teacher_tokens [B, n, K] true predecessors
    (needed by refinement); output_embedding [V, D] the target's lm_head (needed by the
    refinement and the fused path).

    all_sum: for a batch split over devices (inside shard_map), the sum over devices
    (psum). Every normaliser and metric is then the whole batch's, and the returned loss
    is this device's share: the shares sum to the whole batch's loss, so their gradients,
    summed, are its gradient. Default: one device, the share is the loss.

    `config` must be resolved for this drafter (`LossConfig.resolve`)."""
    if not config.resolved:
        raise ConfigError("drafter_loss needs a resolved LossConfig: call "
                          "config.resolve(drafter.config) first")
    total = all_sum or (lambda x: x)
    k = labels.shape[-1]
    w = slot_weights(k, config.gamma) * supervised                      # [B, n, K]
    total_w = jnp.maximum(total(jnp.sum(w)), 1e-9)
    weighted = lambda x: total(jnp.sum(x * w)) / total_w  # noqa: E731  (a metric)
    fused = config.fused_logits
    if not fused and out.logits is None:
        raise ValueError("the dense loss needs the drafter's logits: "
                         "forward_train(..., logits=True)")
    num_candidates = min(config.top_k, output_embedding.shape[0] if fused
                         else out.logits.shape[-1])
    fused_candidates = None
    if fused:       # no [B, n, K, V] tensor: the statistics from the hidden states
        # with the refinement's candidates from the same pass over the lm_head
        lse, label_logit, rank, *top = _slot_stats(
            out.hidden, output_embedding, labels,
            top_k=num_candidates if config.refinement else 0)
        fused_candidates = top[0] if top else None
        frozen = None
    else:
        # Every pass over [B, n, K, V] costs: the logits are read for their log-normaliser,
        # the label's rank (coverage and accuracy in one) and, with a decoding head, the
        # candidates; the probabilities are built only for an L1 term.
        lse = jax.nn.logsumexp(out.logits, axis=-1)                    # [B, n, K]
        label_logit = jnp.take_along_axis(out.logits, labels[..., None], -1)[..., 0]
        frozen = jax.lax.stop_gradient(out.logits)
        rank = label_rank(frozen, labels)                              # [B, n, K]
    ce = lse - label_logit                                             # [B, n, K]
    if config.backbone == "ce+l1" and target_logits is None:
        raise ValueError("this loss needs the target's logits (p_target)")
    if config.refinement and (target_hidden if fused else target_logits) is None:
        raise ValueError("the refinement needs the target's " +
                         ("final hidden states at the slots" if fused else "logits"))

    metrics = {"backbone_ce": weighted(ce)}
    if config.backbone == "ce+l1":
        p_target = jax.nn.softmax(target_logits, -1)
        l1 = jnp.sum(jnp.abs(jnp.exp(out.logits - lse[..., None]) - p_target), -1)
        backbone = config.ce_weight * ce + (1 - config.ce_weight) * l1
        metrics["backbone_l1"] = weighted(l1)
    else:
        backbone = ce
    per_slot = backbone

    label_in = rank < num_candidates
    metrics["coverage"] = _mean_over(label_in, supervised, total)

    if config.refinement:
        candidates = (fused_candidates if fused else          # [B, n, K, C]
                      refinement_candidates(config.candidates, frozen, out.hidden,
                                            output_embedding, num_candidates))
        rows = jnp.take(output_embedding, candidates, axis=0)          # [B, n, K, C, D]
        scores = drafter.transition_scores(out.pre_injection, teacher_tokens[..., None],
                                           rows, output_embedding)[..., 0, :]  # [B,n,K,C]
        logq = jax.nn.log_softmax(scores, -1)
        hit = candidates == labels[..., None]
        ce_ref = -jnp.sum(jnp.where(hit, logq, 0.0), -1) * label_in
        if fused:     # the target's logits at the candidates, its lse from the kernel
            target_lse = _slot_stats(target_hidden, output_embedding, labels)[0][..., None]
            target_c = jnp.einsum("BnKD,BnKCD->BnKC", target_hidden,
                                  rows.astype(target_hidden.dtype),
                                  preferred_element_type=jnp.float32)
        else:
            target_lse = jax.nn.logsumexp(target_logits, -1)[..., None]
            target_c = jnp.take_along_axis(target_logits, candidates, -1)
        p_c = jnp.exp(target_c - target_lse)
        mass = jnp.sum(p_c, -1)
        l1_ref = jnp.sum(jnp.abs(jnp.exp(logq) - p_c / jnp.maximum(mass, 1e-12)[..., None]), -1)
        l1_ref = jnp.where(mass >= config.candidate_mass_threshold, l1_ref, 0.0)
        refinement = config.ce_weight * ce_ref + (1 - config.ce_weight) * l1_ref
        per_slot = per_slot + refinement
        metrics["refinement"] = weighted(refinement)
        refined_top = jnp.take_along_axis(candidates, jnp.argmax(scores, -1)[..., None], -1)
        metrics["refined_accuracy"] = _mean_over(refined_top[..., 0] == labels, supervised,
                                                  total)

    if config.alignment and config.alignment_weight > 0:
        transfer_rank = drafter.config.dspine.transfer_rank
        codes = drafter.code(labels, output_embedding) / math.sqrt(transfer_rank)  # unit
        f = out.features                                                # [L, B, n, K, r]
        cos = jnp.sum(f * codes[None], -1) / jnp.maximum(jnp.linalg.norm(f, axis=-1), 1e-6)
        misalign = jnp.sum(1.0 - cos, axis=0)                           # [B, n, K]
        mean_ce = jax.lax.stop_gradient(metrics["backbone_ce"])
        scale = alignment_scale(step, config.alignment_weight, config.alignment_warmup_steps)
        per_slot = per_slot + scale * mean_ce * misalign
        metrics["alignment"] = weighted(misalign)

    share = jnp.sum(per_slot * w) / total_w
    metrics.update(slot_metrics(rank == 0, supervised, total))
    metrics["loss"] = total(share)
    if out.gates is not None:  # equal-sized shards: the mean of the devices' means
        metrics["gate_mean"] = total(jnp.mean(out.gates)) / total(1.0)
    return share, metrics


def _slot_stats(hidden, output_embedding, labels, top_k: int = 0):
    """(lse, label_logit, rank) [B, n, K] of hidden [B, n, K, D] against the lm_head, by
    `lm_head_stats` (differentiable in hidden); top_k > 0 adds the ids [B, n, K, top_k]
    of each slot's largest logits (no gradient: the candidates are chosen, not learnt)."""
    lead, d = hidden.shape[:-1], hidden.shape[-1]
    stats = lm_head_stats(hidden.reshape(-1, d), output_embedding, labels.reshape(-1),
                          top_k=top_k)
    return tuple(x.reshape(lead + x.shape[1:]) for x in stats)


def refinement_candidates(source: str, frozen_logits, hidden, output_embedding, c: int):
    """[B, n, K, C] int32 the top-C ids of each slot's logits, value descending: from the
    logits themselves ("logits") or recomputed from hidden [B, n, K, D] by `vocab_top_k`
    ("kernel"; the same products, so the same ids up to float32 summation order); "auto"
    is "kernel" on a GPU, where XLA's TopK over the logits is the slow part, else
    "logits" (a CPU would recompute the products for nothing)."""
    if source == "auto":
        source = "kernel" if jax.default_backend() == "gpu" else "logits"
    if source == "logits":
        return top_k_indices(frozen_logits, c)
    from pallas_kernels.dspine_proposal import vocab_top_k

    lead, d = hidden.shape[:-1], hidden.shape[-1]
    _, ids = vocab_top_k(jax.lax.stop_gradient(hidden).reshape(-1, d),
                         jax.lax.stop_gradient(output_embedding), c)
    return ids.reshape(*lead, c)


def _mean_over(values, mask, total=lambda x: x):
    return total(jnp.sum(values * mask)) / jnp.maximum(total(jnp.sum(mask)), 1)


def label_rank(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """[...] int32: where each label stands in lax.top_k's order of its logits [..., V]:
    the entries above it, and the equal ones at a lower index (top_k's ties). The label
    is among the top-C exactly when its rank is below C, and is the argmax at rank 0: one
    reduction over the vocabulary, where a TopK took 18% of a DSpine training step."""
    value = jnp.take_along_axis(logits, labels[..., None], -1)
    before = (logits > value) | ((logits == value)
                                 & (jnp.arange(logits.shape[-1]) < labels[..., None]))
    return jnp.sum(before, -1, dtype=jnp.int32)


def slot_metrics(correct, supervised, total=lambda x: x) -> dict:
    """From correct [B, n, K] (the drafter's argmax is the label, as `label_rank == 0`):
    per-slot accuracy [K], the acceptance length those accuracies imply, and the mean
    accepted prefix measured on the batch's blocks (greedy drafts, T=0). `total`: the sum
    over devices (see drafter_loss)."""
    correct = correct & supervised
    per_slot = (total(jnp.sum(correct, axis=(0, 1)))
                / jnp.maximum(total(jnp.sum(supervised, axis=(0, 1))), 1))
    per_slot = per_slot.at[0].set(1.0)  # the anchor is always right
    estimate = jnp.sum(jnp.cumprod(per_slot[1:])) + 1.0
    full = jnp.all(supervised[..., 1:], -1)                           # blocks with all slots
    prefix = jnp.sum(jnp.cumprod(correct[..., 1:].astype(jnp.int32), -1), -1) + 1
    measured = _mean_over(prefix, full, total)
    return {"slot_accuracy": per_slot, "accept_len_estimate": estimate,
            "accept_len_blocks": measured}
