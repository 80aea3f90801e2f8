"""Serving front end: an OpenAI-compatible HTTP server over `dspine_jax` decoders.

  engine_core   EngineCore: add_request / abort / step / stats over fixed slots
  slots         the slots' page table over one shared KV page pool (host side)
  slot_steps    the compiled prefill / decode calls over the slots
  engine_loop   the core in one background thread; queues to and from the HTTP layer
  detokenizer   incremental text with stop strings
  protocol      OpenAI request models and error bodies
  app           FastAPI routes (/v1/completions, /v1/chat/completions, /v1/models,
                /health, /metrics); metrics: Prometheus
  server        `dspine serve`: build, compile, run uvicorn, drain on SIGTERM
  bench         `dspine bench serve`: a bench_serving-style load generator
"""
