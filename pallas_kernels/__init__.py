"""Pallas kernels, one folder per op, each beside the pure-JAX reference it must equal.

Kernels import nothing from `dspine_jax`. Each op has one public function with an
`implementation="auto" | "xla" | "pallas_tpu" | "pallas_gpu"` switch; "xla" is the
reference (plain JAX, the documentation of what the kernels compute). Every kernel is
tested on the CPU in interpret mode; the GPU kernels also compiled (`pytest -m gpu`), the
TPU kernels not yet on a TPU.

* `ragged_paged_attention` (folder `ragged_paged_attention/`): writes a call's new keys
  and values into a paged KV cache and attends over each row's first kv_lens keys,
  causal (prefill chunks, decode, verification, DSpine's draft block) or bidirectional
  (DFlash's draft block after its context). Mosaic TPU kernel and a Hopper GPU kernel
  (split-KV flash-decoding, Pallas Triton lowering); timings in
  `benchmarks/attention_kernels.py`.
* `dspine_proposal` (folder `dspine_proposal/`): DSpine's decoding head without a
  vocabulary-sized tensor per slot: `vocab_top_k` (the top-C candidates straight from the
  drafter's hidden states and the lm_head, a running top-k over vocabulary tiles; Mosaic
  TPU kernel and a Hopper GPU kernel, Pallas Triton lowering, split over the vocabulary),
  then the C x C transition table and the chain walk in plain JAX (`dspine_proposal`).
* `lm_head_stats` (folder `lm_head_stats/`): what a cross-entropy over an lm_head needs
  (log-normaliser, the label's logit and its rank) from hidden states, without writing
  the [R, V] logits out, differentiable in the hidden states (the backward recomputes the
  logits one vocabulary chunk at a time); the drafters' training loss uses it. Mosaic TPU
  and Hopper GPU (Pallas Triton lowering) forward kernels beside vocabulary chunks in
  plain JAX.
* `decode_layer` (folder `decode_layer/`): a pre-norm SwiGLU decoder layer's element-wise
  work folded into its matmuls for the few rows of a decode step (RMSNorm + q/k/v + RoPE,
  a matmul with its residual add, RMSNorm + gate/up + SiLU); Hopper GPU kernels (Pallas
  Triton lowering) beside the plain-JAX reference. The target runs them with
  `layer_kernels="fused"`; today they are slower than XLA's fusions (docs/benchmarks.md,
  "Fused decode layers"), so XLA's layers stay the default.
* `warp_threshold` (folder `warp_threshold/`): a top-k/top-p warp's threshold per row of
  logits (the kept set is the entries at or above it), by a sort of each row (the
  reference), by a sort-free search in plain JAX, or by the same search with each round
  one Hopper GPU launch (Pallas Triton lowering) that reads every row once; speculative
  verification at T > 0 needs it for every verified position.
* `top_k` (module `top_k.py`): lax.top_k over long rows, exactly; on a GPU grouped (k >= 2)
  or split into chunks when the rows are too few to fill it (XLA's TopK runs one thread
  block per row); the "xla" path of `vocab_top_k` and the engine's argmax and candidate
  top-k use it.
"""

from .dspine_proposal import dspine_proposal, vocab_top_k, vocab_top_k_reference
from .lm_head_stats import lm_head_stats, lm_head_stats_reference
from .ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "dspine_proposal",
           "vocab_top_k", "vocab_top_k_reference", "lm_head_stats", "lm_head_stats_reference"]
