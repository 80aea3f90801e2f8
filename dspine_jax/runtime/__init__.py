"""The slot engine: continuous batching over a paged KV cache.

  engine_core  requests, admission, chunked prefill, preemption and each step's calls
  slot_steps   the compiled prefill and decode calls over slot rows
  slots        page accounting per slot
  offline      `dspine generate --engine slots` and `data regenerate` on the same engine
"""
