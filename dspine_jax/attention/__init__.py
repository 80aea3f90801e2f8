"""Attention for every call site: metadata built once per forward, one backend interface."""

from dspine_jax.attention.backend import (BACKENDS, AttentionBackend, PallasBackend,
                                          XlaBackend, default_backend_name, select_backend)
from dspine_jax.attention.metadata import MASKS, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "MASKS", "PallasBackend",
           "XlaBackend", "default_backend_name", "select_backend"]
