"""Target model configuration: one frozen dataclass for the Qwen3 and Llama families."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dspine_jax.errors import ConfigError

ARCHITECTURES = {
    # HF `architectures` entry / `model_type` -> our family name.
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "qwen3": "qwen3",
    "llama": "llama",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Shapes and numerics of a decoder-only target. Field names follow HF's config.json."""

    family: str  # "qwen3" (q/k RMSNorm per head) or "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # RoPE scaling as sorted (key, value) pairs so the config stays hashable (jit static).
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self):
        if self.family not in ("qwen3", "llama"):
            raise ConfigError(f"family must be 'qwen3' or 'llama', got {self.family!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope_scaling type {rope_type!r} is not supported; "
                              f"supported: {', '.join(ROPE_TYPES)}")

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
        per_layer += 2 * self.head_dim if self.qk_norm else 0
        embeddings = v * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embeddings + d

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "TargetConfig":
        """Build from a transformers config.json dict (transformers 4.x or 5.x layout)."""
        names = list(hf.get("architectures") or []) + [hf.get("model_type")]
        family = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
        if family is None:
            raise ConfigError(
                f"unknown architecture {names[:-1] or names[-1]!r} (model_type "
                f"{hf.get('model_type')!r}); supported: Qwen3ForCausalLM, LlamaForCausalLM")
        if hf.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ConfigError(f"config.json lacks required field(s): {', '.join(missing)}")
        # transformers 5 folds rope_theta and rope_scaling into `rope_parameters`.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        if rope.get("rope_type", "default") == "default":
            rope = {}
        heads = hf["num_attention_heads"]
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=tuple(sorted(rope.items())) or None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
        )

    def to_hf(self) -> dict[str, Any]:
        """The config.json dict transformers reads back into the same model."""
        arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[self.family]
        out = {
            "architectures": [arch], "model_type": self.family,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict or None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias, "hidden_act": "silu",
        }
        if self.family == "llama":
            out["mlp_bias"] = self.mlp_bias
        return out


# Published shapes, for `jax.eval_shape` tests and random-weight benchmarks.
PRESETS: dict[str, TargetConfig] = {
    "qwen3-4b": TargetConfig(
        family="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True),
    "qwen3-8b": TargetConfig(
        family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False),
    "smollm2-135m": TargetConfig(
        family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=1e5,
        tie_word_embeddings=True),
}
