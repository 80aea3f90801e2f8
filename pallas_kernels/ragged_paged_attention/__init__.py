"""Ragged paged attention: attention of this call's queries over a paged KV cache.

`ragged_paged_attention` writes the call's new keys/values into the page pools and attends
over each row's first kv_lens[b] keys, causal or bidirectional. Implementations:
"xla" (reference.py, plain JAX: the documentation of the op), "pallas_tpu" (tpu.py,
Mosaic TPU), "pallas_gpu" (gpu.py, Pallas Triton lowering for Hopper); "auto" picks
pallas_gpu on CUDA, pallas_tpu on TPU and xla elsewhere.
"""

from __future__ import annotations

import functools

import jax

from .common import IMPLEMENTATIONS, MASKS, check_inputs, rotate_qk, split_packed
from ..platform import backend_implementation
from ..switches import current
from .reference import ragged_paged_attention_reference

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "IMPLEMENTATIONS",
           "MASKS"]


def ragged_paged_attention(q, new_k, new_v, k_pages, v_pages, page_table, kv_lens, q_lens,
                           *, mask="causal", sm_scale=None, rope=None, implementation="auto",
                           interpret=False):
    """Writes this call's keys/values into the page pools and attends over the paged cache.

    Args:
      q: [B, T, N, H] queries; row b uses its first q_lens[b], the rest are padding.
        With new_k = new_v = None, q is packed: [B, T, N + 2K, H], each token's N query
        heads, then its K keys, then its K values (a fused q/k/v projection's output
        as it lies, after RoPE), which the GPU kernel reads in place.
      new_k, new_v: [B, T, K, H] keys/values of those T tokens (RoPE already applied).
      k_pages, v_pages: [P, page_size, K, H] the layer's page pools (donate them).
      page_table: [B, pages_per_seq] int32 page ids of each row, in order. An id outside
        [0, P) (the engines use P: "no page") takes no write, and a key read through
        one reads some page of the pool (XLA's scatter drops, its gather clamps).
      kv_lens: [B] int32 keys valid after this call's write (context + q_lens[b]).
      q_lens: [B] int32, 0 <= q_lens <= T; a row with q_lens 0 writes nothing.
      mask: "causal" (query at absolute position p sees keys [0, p]) or "bidirectional"
        (every valid query of row b sees keys [0, kv_lens[b])).
      sm_scale: score scale, default H ** -0.5.
      rope: None (q and new_k come rotated), or (cos, sin), each [B, T, H/2] float32 of
        the tokens' positions: the op rotates q and new_k by them first (half-split RoPE,
        `dspine_jax.rope.apply_rope`'s rule; the pools receive rotated keys). The GPU
        kernel does it as it loads them (calls it writes itself); the other paths in XLA.
      implementation: "auto" | "xla" | "pallas_tpu" | "pallas_gpu".
      interpret: run a Pallas implementation in interpret mode (CPU tests).

    Token t < q_lens[b] of row b is written at absolute position
    p = kv_lens[b] - q_lens[b] + t (page page_table[b, p // page_size], slot
    p % page_size). Supports H in (64, 128), bf16/f32, N = K * G with G in 1..8, page sizes
    8..256 (powers of two); scores and softmax in float32. Outputs at padding queries are
    zeros.

    Returns:
      (out [B, T, N, H], k_pages, v_pages) with the new tokens written.
    """
    # the switches in effect are a static argument: a program is cached per switches
    return _ragged_paged_attention(q, new_k, new_v, k_pages, v_pages, page_table, kv_lens,
                                   q_lens, rope, mask=mask, sm_scale=sm_scale,
                                   implementation=implementation, interpret=interpret,
                                   switches=current())


@functools.partial(jax.jit, static_argnames=("mask", "sm_scale", "implementation",
                                             "interpret", "switches"))
def _ragged_paged_attention(q, new_k, new_v, k_pages, v_pages, page_table, kv_lens, q_lens,
                            rope, *, mask, sm_scale, implementation, interpret, switches):
    with switches.active():
        check_inputs(q, new_k, new_v, k_pages, v_pages, page_table, kv_lens, q_lens, mask=mask,
                     sm_scale=sm_scale, implementation=implementation, rope=rope)
        if implementation == "auto":
            implementation = backend_implementation()
        if implementation == "pallas_gpu":
            from .gpu import ragged_paged_attention_gpu
            return ragged_paged_attention_gpu(q, new_k, new_v, k_pages, v_pages, page_table,
                                              kv_lens, q_lens, mask=mask, sm_scale=sm_scale,
                                              rope=rope, interpret=interpret)
        if rope is not None:
            q, new_k, new_v = rotate_qk(q, new_k, new_v, rope, k_pages.shape[2])
        if new_k is None:
            q, new_k, new_v = split_packed(q, k_pages.shape[2])
        args = (q, new_k, new_v, k_pages, v_pages, page_table, kv_lens, q_lens)
        if implementation == "xla":
            return ragged_paged_attention_reference(*args, mask=mask, sm_scale=sm_scale)
        from .tpu import ragged_paged_attention_tpu
        return ragged_paged_attention_tpu(*args, mask=mask, sm_scale=sm_scale,
                                          interpret=interpret)


