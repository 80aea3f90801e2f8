"""`dspine serve`: load a pipeline, compile, and serve it with uvicorn.

Shutdown (SIGTERM or Ctrl-C): the listening socket closes and every new request gets 503
at once; requests in flight run to their end for up to `grace_seconds`, then are
cancelled (their slots freed); the engine thread stops; the process exits. (uvicorn
re-raises the signal after its graceful shutdown, so the exit status is that of a process
ended by SIGTERM: 143 in a shell.)
"""

from __future__ import annotations

import logging
import time

import uvicorn

from dspine_serve.app import create_app
from dspine_serve.engine_core import DEFAULT_PREFILL_CHUNK, EngineCore
from dspine_serve.engine_loop import EngineLoop

log = logging.getLogger("dspine_serve")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which also tells the engine to refuse new work on the first
    shutdown signal (uvicorn alone would keep answering on open keep-alive connections)."""

    def __init__(self, config: uvicorn.Config, engine: EngineLoop):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        self.engine.drain()
        super().handle_exit(sig, frame)


def build(pipeline, *, model_name: str, max_slots: int = 8, max_model_len: int | None = None,
          max_queue: int = 256, num_pages: int | None = None,
          prefill_chunk: int = DEFAULT_PREFILL_CHUNK, warmup: bool = True):
    """(app, engine) for a loaded `Pipeline`; compiles before returning when `warmup`.
    num_pages: the KV page pool the slots share (default: a full max_model_len for
    every slot); prefill_chunk: prompt tokens prefilled per step and request."""
    core = EngineCore(pipeline.decoder, max_slots=max_slots, max_model_len=max_model_len,
                      num_pages=num_pages, prefill_chunk=prefill_chunk)
    if warmup:
        seconds = core.warmup()
        log.info("compiled in %.1fs", seconds)
    engine = EngineLoop(core, max_queue=max_queue)
    app = create_app(engine, pipeline.tokenizer, model_name=model_name,
                     method=pipeline.method)
    return app, engine


def run(pipeline, *, model_name: str, host: str = "127.0.0.1", port: int = 8000,
        max_slots: int = 8, max_model_len: int | None = None, max_queue: int = 256,
        num_pages: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        grace_seconds: float = 30.0, log_level: str = "info") -> None:
    t0 = time.perf_counter()
    app, engine = build(pipeline, model_name=model_name, max_slots=max_slots,
                        max_model_len=max_model_len, max_queue=max_queue,
                        num_pages=num_pages, prefill_chunk=prefill_chunk)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=grace_seconds, lifespan="on",
                            access_log=False)
    server = DrainingServer(config, engine)
    print(f"serving {model_name} ({pipeline.method}, {max_slots} slots, context "
          f"{engine.core.max_model_len}, {engine.core.num_pages} KV pages of "
          f"{pipeline.decoder.page_size}) on http://{host}:{port} after "
          f"{time.perf_counter() - t0:.1f}s of compilation", flush=True)
    server.run()
