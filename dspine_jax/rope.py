"""Rotary position embeddings in HF's half-split layout, with the checkpoint's scaling.

The frequency tables are computed once in float64 numpy; only `apply_rope` runs under jit.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from pallas_kernels.rope import rotate_half_split

from dspine_jax.config import TargetConfig


def rope_frequencies(config: TargetConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim / 2] and the attention scaling factor for cos/sin."""
    dim, base = config.head_dim, config.rope_theta
    scaling = config.rope_scaling_dict
    kind = scaling.get("rope_type", "default")
    inv_freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn_frequencies(config, scaling)
    raise AssertionError(kind)  # TargetConfig validated the type already


def _llama3_frequencies(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return np.where(medium, smoothed, scaled)


def _yarn_frequencies(config: TargetConfig, s: dict) -> tuple[np.ndarray, float]:
    dim, base = config.head_dim, config.rope_theta
    original = s.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = s.get("factor") or config.max_position_embeddings / original
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp  # 1 where a dimension keeps its original frequency
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_table(positions: jnp.ndarray, inv_freq: np.ndarray,
               attention_factor: float = 1.0) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin [..., H/2] float32 of integer positions [...] (scaling included)."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray,
               attention_factor: float = 1.0) -> jnp.ndarray:
    """Rotate x [B, T, N, H] at integer positions [B, T]; float32 math, x's dtype out."""
    return rotate_half_split(x, *rope_table(positions, inv_freq, attention_factor))
