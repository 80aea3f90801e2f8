"""Which kernels run a target layer's forward: XLA's (one kernel or more per norm, matmul,
RoPE half and residual add) or `pallas_kernels.decode_layer`'s four per layer, for the
few rows of a decode step or a verification pass.

A decode step of a small target is launch-bound: SmolLM2-135M's 30 layers cost ~1 ms on
an H200 for ~0.08 ms of weight reads. `FusedLayers` folds each layer's element-wise work
into its matmuls (`norm_qkv_rope`, the paged attention, `matmul_residual` twice,
`norm_swiglu`) wherever a call has at most `max_rows` rows (batch x new tokens) and the
attention is paged; prefill chunks, training and larger batches keep XLA's layers.

Shape legend: B batch, T new tokens, D hidden, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses

import jax

from dspine_jax.config import TargetConfig
from dspine_jax.errors import ConfigError
from dspine_jax.rope import rope_frequencies, rope_table

LAYER_KERNELS = ("xla", "fused")


@dataclasses.dataclass(frozen=True)
class FusedLayers:
    """implementation: pallas_kernels.decode_layer's ("pallas_gpu", or "xla": its plain
    JAX reference, for tests); interpret: Pallas interpret mode (CPU tests)."""
    implementation: str = "pallas_gpu"
    interpret: bool = False
    max_rows: int = 16

    @staticmethod
    def unsupported(config: TargetConfig) -> str | None:
        """Why a target of this config cannot run fused layers (None: it can)."""
        if config.attention_bias or config.mlp_bias:
            return "biased projections"
        if config.head_dim < 32 or config.head_dim % 32:
            return f"head_dim {config.head_dim} (a multiple of 32 is needed)"
        for name in ("hidden_size", "intermediate_size"):
            if getattr(config, name) % 16:
                return f"{name} {getattr(config, name)} (a multiple of 16 is needed)"
        return None

    def applies(self, rows: int, paged: bool) -> bool:
        return paged and rows <= self.max_rows

    def ops(self):
        """The three ops with this record's implementation bound."""
        from pallas_kernels import decode_layer

        kw = {"implementation": self.implementation, "interpret": self.interpret}
        return (lambda *a, **k: decode_layer.norm_qkv_rope(*a, **k, **kw),
                lambda *a, **k: decode_layer.matmul_residual(*a, **k, **kw),
                lambda *a, **k: decode_layer.norm_swiglu(*a, **k, **kw))


def select_layer_kernels(choice, config: TargetConfig) -> FusedLayers | None:
    """"xla" -> None; "fused" -> the GPU kernels (ConfigError where the platform or the
    target's shapes cannot run them); a FusedLayers passes through."""
    if isinstance(choice, FusedLayers):
        return choice
    if choice not in LAYER_KERNELS:
        raise ConfigError(f"layer_kernels must be one of {LAYER_KERNELS}, got {choice!r}")
    if choice == "xla":
        return None
    if jax.default_backend() != "gpu":
        raise ConfigError("layer_kernels='fused' runs on CUDA GPUs (Pallas Triton kernels); "
                          f"this backend is {jax.default_backend()}")
    why = FusedLayers.unsupported(config)
    if why:
        raise ConfigError(f"layer_kernels='fused' cannot run this target: {why}")
    return FusedLayers()


def rope_rows(config: TargetConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B * T, H/2] float32 of positions [B, T]: one table for every layer."""
    return rope_table(positions.reshape(-1), *rope_frequencies(config))
