"""The engine core in one background thread; the HTTP side talks to it through queues.

The thread owns the `EngineCore` (and so every device array): it takes commands (add,
abort) from a thread-safe queue, runs `step()` while there is work, and hands each
request's outputs to that request's sink (for the server: an asyncio queue, filled with
`loop.call_soon_threadsafe`, once per step for all the requests of one event loop: a
wake-up per request and step was 64 self-pipe writes per step at 64 streams). It blocks
on the command queue when idle.

Admission control happens on submit, before anything is queued: at most
`max_slots + max_queue` requests are in the engine at once; one more is refused
(`QueueFull`, the server's 429) instead of growing memory. After `drain()` every new
request is refused (`Draining`, 503) while those in flight finish. A loop given a
`warmup` runs it first, in the thread (the server compiles while it already answers:
`starting` is true and requests are refused with `Starting`, 503).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable, Sequence

from dspine_jax.runtime.engine_core import (EngineCore, EngineStats, QueueFull, RequestOutput,
                                      SamplingOptions)

log = logging.getLogger("dspine_serve")

__all__ = ["EngineLoop", "RequestStream", "QueueFull", "Draining", "EngineDead", "Starting"]


class Draining(Exception):
    """The server is shutting down and takes no new requests."""


class EngineDead(Exception):
    """The engine thread stopped on an error; nothing more is served."""


class Starting(Exception):
    """The engine is still compiling; nothing is served yet."""


Sink = Callable[[RequestOutput | BaseException], None]    # or a _LoopSink


class EngineLoop:
    def __init__(self, core: EngineCore, *, max_queue: int = 256,
                 on_step: Callable[[list[RequestOutput], EngineStats], None] | None = None,
                 warmup: Callable[[], object] | None = None,
                 on_ready: Callable[[float], None] | None = None):
        """warmup: run first in the engine thread (compilation); on_ready(seconds) after
        it."""
        self.core = core
        self._warmup, self._on_ready = warmup, on_ready
        self._starting = warmup is not None
        self.capacity = core.max_slots + max_queue
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()
        self._in_flight = 0
        self._draining = False
        self._error: BaseException | None = None
        self._stats = core.stats()
        self._thread = threading.Thread(target=self._run, name="dspine-engine", daemon=True)

    # ----- called from any thread -------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is left and end the thread."""
        self._draining = True
        self._commands.put(("stop",))
        self._thread.join(timeout)

    def drain(self) -> None:
        """Refuse new requests from now on; those in flight continue."""
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def starting(self) -> bool:
        return self._starting

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def stats(self) -> EngineStats:
        """The snapshot after the last step (no device read, no lock on the engine), with
        the programs compiling in the background now."""
        return dataclasses.replace(self._stats, compiling=self.core.compiling)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def check_request(self, prompt_token_ids: Sequence[int], options: SamplingOptions) -> None:
        self.core.check_request(prompt_token_ids, options)  # host-side checks only

    def submit(self, request_id: str, prompt_token_ids: Sequence[int],
               options: SamplingOptions, sink: Sink) -> None:
        if self._error is not None or not self._thread.is_alive():
            raise EngineDead(f"the engine stopped: {self._error!r}")
        if self._draining:
            raise Draining("the server is shutting down")
        if self._starting:
            raise Starting("the server is starting (compiling its programs); retry when "
                           "GET /health answers 200")
        self.core.check_request(prompt_token_ids, options)
        with self._lock:
            if self._in_flight >= self.capacity:
                raise QueueFull(f"the server is at capacity ({self.capacity} requests "
                                "running or waiting); retry later")
            self._in_flight += 1
        self._commands.put(("add", request_id, list(prompt_token_ids), options, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                 options: SamplingOptions) -> "RequestStream":
        """Submit now (QueueFull / Draining / InputError raise here, before any response
        starts) and return the request's outputs as an async iterator. The caller closes
        it when it stops listening (a client gone): that aborts the request and frees its
        slot."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        self.submit(request_id, prompt_token_ids, options, _LoopSink(loop, outputs))
        return RequestStream(self, request_id, outputs)

    # ----- the engine thread -----------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._warmup is not None:
                start = time.perf_counter()
                self._warmup()
                self._stats = self.core.stats()
                self._starting = False
                if self._on_ready is not None:
                    self._on_ready(time.perf_counter() - start)
            while True:
                block = not self.core.has_work()
                while True:
                    try:
                        command = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    if command[0] == "stop":
                        self._abort_all()
                        return
                    self._apply(command)
                if self.core.has_work():
                    # first tokens go to their streams before the decode call ends
                    outputs = self.core.step(on_first_tokens=self._dispatch)
                    self._stats = self.core.stats()
                    self._dispatch(outputs)
                    if self.on_step is not None:
                        self.on_step(outputs, self._stats)
        except BaseException as e:  # noqa: BLE001 - every waiting client must hear of it
            log.exception("engine thread stopped")
            self._error = e
            for sink in list(self._sinks.values()):
                _deliver(sink, EngineDead(f"the engine stopped: {e!r}"))
            self._sinks.clear()
        finally:
            self.core.close()        # the loop owns its core: its runner thread ends too

    def _apply(self, command) -> None:
        if command[0] == "add":
            _, request_id, prompt, options, sink = command
            try:
                self.core.add_request(request_id, prompt, options)
            except Exception as e:  # noqa: BLE001 - the client gets the error
                self._finish_count()
                _deliver(sink, e)
                return
            self._sinks[request_id] = sink
        elif command[0] == "abort":
            self.core.abort(command[1])

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their sinks: those of one event loop in one
        `call_soon_threadsafe` (one wake-up of the loop per step, not one per request)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if isinstance(sink, _LoopSink):
                batches.setdefault(sink.loop, []).append((sink.queue, out))
            else:
                _deliver(sink, out)
            if out.finished:
                del self._sinks[out.request_id]
                self._finish_count()
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:      # the loop has closed: the server is going down
                pass

    def _finish_count(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _abort_all(self) -> None:
        for request_id in list(self._sinks):
            self.core.abort(request_id)
        while self.core.has_work():
            self._dispatch(self.core.step())
        self._stats = self.core.stats()


class RequestStream:
    """One request's outputs, in order, ending with the finished one."""

    def __init__(self, engine: EngineLoop, request_id: str, outputs: asyncio.Queue):
        self.engine, self.request_id, self._outputs = engine, request_id, outputs
        self.finished = False     # the engine sent the last output (or an error)
        self.closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it finished; safe to call twice."""
        if not self.finished and not self.closed:
            self.engine.abort(self.request_id)
        self.closed = True


def _deliver(sink: Sink, item) -> None:
    """A sink whose event loop has closed (the server is going down) is no engine error."""
    try:
        sink(item)
    except RuntimeError:
        pass


class _LoopSink:
    """A sink that puts each item on an asyncio queue of `loop` (from the engine thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue = loop, queue

    def __call__(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for queue_, item in batch:
        queue_.put_nowait(item)
