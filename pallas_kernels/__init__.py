"""Pallas kernels, one folder per op, each beside the pure-JAX reference it must equal.

Kernels import nothing from `dspine_jax`. None is written yet: every op runs as its
reference in `dspine_jax` (attention: `layers.dot_product_attention`; DSpine's transition
table: `BlockDrafter.transition_scores`). The measured first candidates are a ragged
attention over the KV cache (dense attention reads the whole cache capacity) and fused
decode layers for small targets (SmolLM2 decoding is launch-bound; docs/benchmarks.md).
"""
