"""`dspine serve`: load a pipeline, compile, and serve it with uvicorn.

The port is bound first (a busy one is an error at once), then the server answers while
its programs compile in the engine thread (/health: 503 "starting", then 200), with
JAX's persistent compilation cache so that a restart skips most of the compiling.

Shutdown (SIGTERM or Ctrl-C): the listening socket closes and every new request gets 503
at once; requests in flight run to their end for up to `grace_seconds`, then are
cancelled (their slots freed); the engine thread stops; the process exits. (uvicorn
re-raises the signal after its graceful shutdown, so the exit status is that of a process
ended by SIGTERM: 143 in a shell.)
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import time

import uvicorn

from dspine_jax.errors import InputError
from dspine_serve.app import create_app
from dspine_jax.runtime.engine_core import EngineConfig, EngineCore
from dspine_serve.engine_loop import EngineLoop

log = logging.getLogger("dspine_serve")

# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms).
# The engine thread waits for the device with the GIL released; when the device is done
# it needs the GIL back from the event loop, which at many streams always has work: by
# default that wait can be as long as a decode call.
GIL_SWITCH_SECONDS = 0.0005


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which also tells the engine to refuse new work on the first
    shutdown signal (uvicorn alone would keep answering on open keep-alive connections)."""

    def __init__(self, config: uvicorn.Config, engine: EngineLoop):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        self.engine.drain()
        super().handle_exit(sig, frame)


def build(pipeline, engine_config: EngineConfig = EngineConfig(), *, model_name: str,
          max_queue: int = 256, warmup: str | None = "now", api_key: str | None = None,
          on_ready=None):
    """(app, engine) for a loaded `Pipeline` over an engine of `engine_config`. warmup:
    "now" compiles before returning, "background" in the engine thread once the app
    starts (/health answers 503 "starting" until it is done, then on_ready(seconds) is
    called), None not at all. max_queue: requests waiting for a slot before HTTP 429;
    api_key: see `create_app`."""
    if warmup not in ("now", "background", None):
        raise ValueError(f"warmup must be 'now', 'background' or None, got {warmup!r}")
    core = EngineCore(pipeline.decoder, engine_config)
    if warmup == "now":
        seconds = core.warmup()
        log.info("compiled in %.1fs", seconds)
    engine = EngineLoop(core, max_queue=max_queue,
                        warmup=core.warmup if warmup == "background" else None,
                        on_ready=on_ready)
    app = create_app(engine, pipeline.tokenizer, model_name=model_name,
                     method=pipeline.method, api_key=api_key)
    return app, engine


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a busy port is an error before anything loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e} (another "
                         "server on that port? pick another with --port)") from e
    sock.set_inheritable(True)
    return sock


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(pipeline, engine_config: EngineConfig, *, model_name: str, sock: socket.socket,
        max_queue: int = 256, grace_seconds: float = 30.0, api_key: str | None = None,
        log_level: str = "info") -> None:
    """Serve on `sock` (from `bind`) at once: the programs compile in the engine thread
    while /health answers 503 "starting"."""
    t0 = time.perf_counter()
    host, port = sock.getsockname()[:2]
    sys.setswitchinterval(GIL_SWITCH_SECONDS)     # the process is the server's own

    starting = [True]

    def program_ready(timing) -> None:     # a line per program until ready
        if starting[0]:
            print(f"  {timing.describe()}", flush=True)

    def ready(seconds: float) -> None:
        starting[0] = False
        later = engine.core.compiling
        programs, stored = engine.core.programs
        print(f"ready: {programs} programs in {seconds:.1f}s ({stored} from the program store; "
              f"{time.perf_counter() - t0:.1f}s after listening)"
              + (f"; {later} more programs compile in the background, their calls running "
                 "on these meanwhile" if later else ""), flush=True)
        if later:
            engine.core.background_compile.add_done_callback(lambda _: print(
                f"compiled every program ({time.perf_counter() - t0:.1f}s after listening; "
                f"{summary()})", flush=True))

    def summary() -> str:
        timings = engine.core.program_timings
        return (f"{len(timings)} programs, tracing {sum(t.traced for t in timings):.1f}s and "
                f"compiling {sum(t.compiled for t in timings):.1f}s in all")

    app, engine = build(pipeline, engine_config, model_name=model_name, max_queue=max_queue,
                        warmup="background", api_key=api_key, on_ready=ready)
    engine.core.on_program_ready(program_ready)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=grace_seconds,
                            lifespan="on", access_log=False)
    server = DrainingServer(config, engine)
    print(f"serving {model_name} ({pipeline.method}, {engine_config.max_slots} slots, context "
          f"{engine.core.max_model_len}, {engine.core.num_pages} KV pages of "
          f"{pipeline.decoder.page_size}) on http://{host}:{port}; compiling: /health "
          "answers 503 until ready", flush=True)
    server.run(sockets=[sock])
