"""The engine: continuous batching over a paged KV cache, behind every front end.

  engine_core  requests, admission, chunked prefill, preemption and each step's calls
  slot_steps   the compiled prefill and decode calls over slot rows
  slots        page accounting per slot
  offline      a list of prompts through it (`generate`, `eval`, `parity`, `data regenerate`)
  fixed_batch  its compiled calls driven one by one (step benchmarks, the cost table)
  config       RuntimeConfig: what a decoder runs with
"""
