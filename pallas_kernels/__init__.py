"""Pallas kernels, one folder per op, each beside the pure-JAX reference it must equal.

Kernels import nothing from `dspine_jax`. The first ones (attention over the KV cache,
DSpine's transition scores) land with the speculative decoding engine; until then every
op runs as the reference in `dspine_jax.layers`.
"""
