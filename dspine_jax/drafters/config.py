"""Drafter configurations: DFlash's (the reference's config.json fields) and DSpine's switches."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dspine_jax.config import TargetConfig
from dspine_jax.errors import ConfigError


# Conventional mask tokens first. SmolLM2's vocabulary has no spare row and no mask token:
# its `<reponame>` (id 4) is a code-pretraining control token (the repository-name marker
# of StarCoder-style data; SmolLM2 also has `<repo_name>`, id 3) that chat never emits.
MASK_TOKEN_CANDIDATES = ("<|MASK|>", "<|mask|>", "<mask>", "<MASK>", "<reponame>")


def mask_token_for(tokenizer) -> int:
    """The drafter's mask token id: the first of MASK_TOKEN_CANDIDATES the vocabulary has."""
    for text in MASK_TOKEN_CANDIDATES:
        token_id = tokenizer.tokenizer.token_to_id(text)
        if token_id is not None:
            return token_id
    raise ConfigError("the target's vocabulary has none of the known mask tokens "
                      f"{MASK_TOKEN_CANDIDATES}; pass --mask-token-id with an id the target "
                      "never generates")


def build_target_layer_ids(num_target_layers: int, num_features: int) -> tuple[int, ...]:
    """DFlash's choice: `num_features` layers spread evenly from 1 to L_t - 3 (rounded as
    Python rounds). Qwen3-8B (36 layers), 5 features: (1, 9, 17, 25, 33)."""
    if num_features == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_features - 1)))
                 for i in range(num_features))


@dataclasses.dataclass(frozen=True)
class DSpineConfig:
    """DSpine's architecture (names follow the reference's `dspine_config`) and the
    inference-time ablation switches of design doc section 3. What only training reads
    (loss weights, the teacher-replacement curriculum, the alignment switch) lives in
    `dspine_jax.losses.LossConfig`, so a checkpoint stores the network, not its recipe."""

    transfer_rank: int = 512            # r (paper: 1024 at H=4096; r <= H)
    message_size: int = 256             # m
    top_k: int = 16                     # candidates per slot for the decoding head
    # [switch]es
    injection: bool = True              # gated adjacent injection after every layer
    causal_block: bool = True           # False: DFlash's bidirectional block attention
    refinement_head: bool = True        # predecessor-conditioned decoding at inference
    # Sampling (T > 0) only; T = 0 decodes the same either way. All keep decoding exact:
    # q is whatever the draft was drawn from (benchmarks/t1_acceptance.py measures them).
    chain_temperature: float = 1.0      # the chain's scores are warped at T * this
    marginal_tail: bool = False         # q = the base marginal outside the C candidates
    vocabulary_chain: bool = False      # the chain's row over the whole vocabulary, not C

    def __post_init__(self):
        for name in ("transfer_rank", "message_size", "top_k"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(f"dspine.{name} must be a positive integer, "
                                  f"got {getattr(self, name)!r}")
        t = self.chain_temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ConfigError(f"dspine.chain_temperature must be a positive number, got {t!r}")
        for name in ("marginal_tail", "vocabulary_chain"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"dspine.{name} must be true or false, "
                                  f"got {getattr(self, name)!r}")
        if self.marginal_tail and self.vocabulary_chain:
            raise ConfigError("dspine.marginal_tail and dspine.vocabulary_chain exclude each "
                              "other: the vocabulary chain has no tail outside its support")


# `dspine_config` holds the reference's fields; the project's ablation switches have
# their own key, `dspine_jax_switches` (checkpoints written before that kept them in
# `dspine_config`; both layouts load).
REFERENCE_FIELDS = ("transfer_rank", "message_size", "top_k")
SWITCHES = ("injection", "causal_block", "refinement_head")
# How the head samples at T > 0, under `dspine_jax_decoding`; written only when not the
# default, so checkpoints without it (and readers that predate it) are unchanged.
DECODING = {"chain_temperature": 1.0, "marginal_tail": False, "vocabulary_chain": False}

# Training-only fields that drafter checkpoints written before the split carried in
# `dspine_config`; they are read past (the loss config holds them now).
TRAINING_ONLY_FIELDS = frozenset({
    "ce_weight", "alignment_weight", "alignment_warmup_steps", "replacement_layers",
    "replacement_probability", "replacement_hold_ratio", "replacement_end_ratio",
    "candidate_mass_threshold", "teacher_replacement", "alignment"})


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A block drafter over a target. `dspine=None` is DFlash."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int          # draft layers (paper: 5)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    dspine: DSpineConfig | None = None

    def __post_init__(self):
        if self.block_size < 2:
            raise ConfigError(f"block_size must be at least 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids must name at least one target layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ConfigError(f"target_layer_ids {bad} out of range for a "
                              f"{self.num_target_layers}-layer target")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                              f"[0, {self.vocab_size})")
        if self.dspine is not None and self.dspine.transfer_rank > self.hidden_size:
            raise ConfigError(f"dspine.transfer_rank ({self.dspine.transfer_rank}) must not "
                              f"exceed hidden_size ({self.hidden_size})")
        self.layer_config()  # validates the attention shapes

    @property
    def kind(self) -> str:
        return "dflash" if self.dspine is None else "dspine"

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def injecting(self) -> bool:
        """DSpine with its gated adjacent injection on."""
        return self.dspine is not None and self.dspine.injection

    @property
    def causal_block(self) -> bool:
        return self.dspine is not None and self.dspine.causal_block

    def layer_config(self) -> TargetConfig:
        """The draft layers are Qwen3 decoder layers with these shapes."""
        return TargetConfig(
            family="qwen3", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling)

    @classmethod
    def for_target(cls, target: TargetConfig, *, kind: str = "dspine", num_layers: int = 5,
                   mask_token_id: int, block_size: int = 16, num_features: int | None = None,
                   dspine: DSpineConfig | None = None) -> "DrafterConfig":
        """The paper's recipe: draft layers at the target's width and attention shapes."""
        if kind not in ("dflash", "dspine"):
            raise ConfigError(f"drafter kind must be 'dflash' or 'dspine', got {kind!r}")
        ids = build_target_layer_ids(target.num_hidden_layers, num_features or num_layers)
        return cls(
            hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
            vocab_size=target.vocab_size, num_target_layers=target.num_hidden_layers,
            target_layer_ids=ids, mask_token_id=mask_token_id, block_size=block_size,
            rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
            dspine=(dspine or cls.default_dspine(target.hidden_size))
            if kind == "dspine" else None)

    @staticmethod
    def default_dspine(hidden_size: int) -> DSpineConfig:
        """r = 512, m = 256 (our SmolLM2 choice; the paper's 1024/512 is for H >= 2560),
        shrunk for narrower targets since r may not exceed H."""
        rank = min(512, hidden_size)
        return DSpineConfig(transfer_rank=rank, message_size=max(1, min(256, rank // 2)))

    def check_target(self, target: TargetConfig) -> None:
        """A drafter only runs on the target it was built for: say which field disagrees."""
        pairs = [("hidden_size", self.hidden_size, target.hidden_size),
                 ("vocab_size", self.vocab_size, target.vocab_size),
                 ("num_target_layers", self.num_target_layers, target.num_hidden_layers)]
        for name, mine, theirs in pairs:
            if mine != theirs:
                raise ConfigError(f"drafter and target disagree: drafter {name} is {mine}, "
                                  f"the target's is {theirs}")
        bad = [i for i in self.target_layer_ids if i >= target.num_hidden_layers]
        if bad:
            raise ConfigError(f"drafter reads target layers {bad}, but the target has only "
                              f"{target.num_hidden_layers} layers")

    # ----- the reference's config.json ------------------------------------------------------
    def to_hf(self) -> dict[str, Any]:
        out = {
            "architectures": ["DFlashDraftModel" if self.dspine is None else "DSpineDraftModel"],
            "model_type": "qwen3", "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": dict(self.rope_scaling or ()) or None,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False,
            "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids),
                              "block_size": self.block_size},
        }
        if self.dspine is not None:
            spine = dataclasses.asdict(self.dspine)
            out["dspine_config"] = {k: spine[k] for k in REFERENCE_FIELDS}
            out["dspine_jax_switches"] = {k: spine[k] for k in SWITCHES}
            decoding = {k: spine[k] for k, default in DECODING.items() if spine[k] != default}
            if decoding:
                out["dspine_jax_decoding"] = decoding
        return out

    def check_reference_layout(self) -> None:
        """The reference DSpine has no ablation switches: it always injects, attends
        causally inside the block and decodes with the predecessor-conditioned head. A
        drafter with a switch off cannot be written in its layout: say which."""
        if self.dspine is None:
            return
        off = [name for name in SWITCHES if not getattr(self.dspine, name)]
        if off:
            raise ConfigError(
                f"this DSpine drafter has {', '.join(f'{n}=False' for n in off)}; the "
                "reference DSpine layout cannot represent that switch (it always runs with "
                f"{', '.join(f'{n}=True' for n in off)}). Use the checkpoint folder itself "
                "(its config.json keeps the switch under dspine_jax_switches; dspine_torch "
                "reads it).")

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> "DrafterConfig":
        arch = (raw.get("architectures") or [None])[0]
        if arch not in ("DFlashDraftModel", "DSpineDraftModel"):
            raise ConfigError(f"not a DFlash/DSpine drafter config: architectures={arch!r}")
        flash = raw.get("dflash_config") or {}
        windowed = sorted(set(raw.get("layer_types") or ()) - {"full_attention"})
        if windowed:
            raise ConfigError(f"drafter config.json has layer_types {windowed}: only "
                              "full-attention draft layers are supported")
        try:
            rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
            theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
            if rope.get("rope_type", "default") == "default":
                rope = {}
            spine = _read_dspine(raw)
            return cls(
                hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=raw["num_attention_heads"],
                num_key_value_heads=raw["num_key_value_heads"],
                head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
                vocab_size=raw["vocab_size"], num_target_layers=raw["num_target_layers"],
                target_layer_ids=tuple(flash.get("target_layer_ids") or build_target_layer_ids(
                    raw["num_target_layers"], raw["num_hidden_layers"])),
                mask_token_id=flash["mask_token_id"],
                block_size=raw.get("block_size") or flash.get("block_size", 16),
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
                rope_scaling=tuple(sorted(rope.items())) or None,
                max_position_embeddings=raw.get("max_position_embeddings", 4096),
                dspine=None if spine is None else DSpineConfig(**spine))
        except KeyError as e:
            raise ConfigError(f"drafter config.json lacks field {e.args[0]!r}") from e


def _read_dspine(raw: Mapping[str, Any]) -> dict | None:
    """DSpineConfig's fields from config.json: `dspine_config` (reference fields; old
    checkpoints also carry the switches there) and `dspine_jax_switches`."""
    spine = raw.get("dspine_config")
    switches = dict(raw.get("dspine_jax_switches") or {})
    decoding = dict(raw.get("dspine_jax_decoding") or {})
    if spine is None:
        if switches or decoding:
            raise ConfigError("config.json has dspine_jax_switches or dspine_jax_decoding but "
                              "no dspine_config")
        return None
    if set(decoding) - set(DECODING):
        raise ConfigError(f"dspine_jax_decoding has unknown field(s): "
                          f"{sorted(set(decoding) - set(DECODING))}")
    spine = {k: v for k, v in spine.items() if k not in TRAINING_ONLY_FIELDS}
    unknown = set(spine) - set(REFERENCE_FIELDS) - set(SWITCHES)
    if unknown:
        raise ConfigError(f"dspine_config has unknown field(s): {sorted(unknown)}")
    bad = set(switches) - set(SWITCHES)
    if bad:
        raise ConfigError(f"dspine_jax_switches has unknown field(s): {sorted(bad)}")
    for name in SWITCHES:
        if name in spine and name in switches and bool(spine[name]) != bool(switches[name]):
            raise ConfigError(f"dspine_config.{name}={spine[name]} disagrees with "
                              f"dspine_jax_switches.{name}={switches[name]}")
    return {**spine, **switches, **decoding}
