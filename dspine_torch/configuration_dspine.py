"""Configurations of the PyTorch DFlash and DSpine drafters (config.json of an export).

The drafter's layers are Qwen3 decoder layers, so the configs extend transformers'
`Qwen3Config` (RoPE parameters, norms, attention shapes) with the drafter's fields:

  block_size, num_target_layers      the block (anchor + K-1 slots) and the target's depth
  dflash_config                      {mask_token_id, target_layer_ids, block_size}
  dspine_config                      {transfer_rank, message_size, top_k} (+ the reference's
                                     training-only fields, which inference ignores)
  dspine_jax_switches                {injection, causal_block, refinement_head}: the
                                     ablation switches; absent means all on (the reference)

This file is shipped beside exported weights for `trust_remote_code=True`; it imports
only transformers.
"""

from __future__ import annotations

from transformers import Qwen3Config

REFERENCE_DSPINE_FIELDS = ("transfer_rank", "message_size", "top_k")
# What the reference's dspine_config also carries: training settings, no effect on drafting.
TRAINING_ONLY_FIELDS = frozenset({
    "ce_weight", "alignment_weight", "alignment_warmup_steps", "replacement_layers",
    "replacement_probability", "replacement_hold_ratio", "replacement_end_ratio",
    "candidate_mass_threshold", "teacher_replacement", "alignment"})
SWITCHES = ("injection", "causal_block", "refinement_head")


def _target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """DFlash's default: features spread evenly from layer 1 to L_t - 3."""
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_features - 1)))
            for i in range(num_features)]


class DFlashDraftConfig(Qwen3Config):
    """A block drafter with DFlash's bidirectional block and per-slot decoding."""

    model_type = "qwen3"  # the reference layout's value: the draft layers are Qwen3 layers

    def __init__(self, block_size: int = 16, num_target_layers: int | None = None,
                 dflash_config: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        self.dflash_config = dict(dflash_config or {})
        self.block_size = int(block_size or self.dflash_config.get("block_size", 16))
        self.num_target_layers = num_target_layers

    @property
    def mask_token_id(self) -> int:
        if "mask_token_id" not in self.dflash_config:
            raise ValueError("drafter config lacks dflash_config.mask_token_id")
        return int(self.dflash_config["mask_token_id"])

    @property
    def target_layer_ids(self) -> list[int]:
        ids = self.dflash_config.get("target_layer_ids")
        if ids:
            return [int(i) for i in ids]
        if self.num_target_layers is None:
            raise ValueError("drafter config has neither target_layer_ids nor "
                             "num_target_layers")
        return _target_layer_ids(self.num_target_layers, self.num_hidden_layers)


class DSpineDraftConfig(DFlashDraftConfig):
    """DFlash plus DSpine's transfer space, gated adjacent injection and decoding head."""

    def __init__(self, dspine_config: dict | None = None,
                 dspine_jax_switches: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        spine = dict(dspine_config or {})
        switches = dict(dspine_jax_switches or {})
        # Checkpoints written before the split kept the switches inside dspine_config.
        for name in SWITCHES:
            if name in spine:
                old = bool(spine.pop(name))
                if switches.setdefault(name, old) != old:
                    raise ValueError(f"dspine_config.{name}={old} disagrees with "
                                     f"dspine_jax_switches.{name}={switches[name]}")
        unknown = set(spine) - set(REFERENCE_DSPINE_FIELDS) - TRAINING_ONLY_FIELDS
        if unknown:
            raise ValueError(f"dspine_config has unknown field(s): {sorted(unknown)}")
        bad = set(switches) - set(SWITCHES)
        if bad:
            raise ValueError(f"dspine_jax_switches has unknown field(s): {sorted(bad)}")
        spine.setdefault("transfer_rank", 1024)
        spine.setdefault("message_size", 512)
        spine.setdefault("top_k", 16)
        self.dspine_config = spine
        self.dspine_jax_switches = {name: bool(switches.get(name, True)) for name in SWITCHES}

    @property
    def transfer_rank(self) -> int:
        return int(self.dspine_config["transfer_rank"])

    @property
    def message_size(self) -> int:
        return int(self.dspine_config["message_size"])

    @property
    def top_k(self) -> int:
        return int(self.dspine_config["top_k"])

    def switch(self, name: str) -> bool:
        return self.dspine_jax_switches[name]
