"""A decoder whose device only waits: the engine core's real scheduler, runner threads,
pipelined steps and adaptive policy over calls that sleep a cost model's device time and
emit tokens with a given acceptance profile. It tells, without an accelerator, what the
engine and server do with a device of known costs: whether a serving figure is bound by
the device (the model's time) or by everything around it (the host, the order of calls,
slots waiting for requests).

The cost model, per call (milliseconds):
  decode   passes x pass(rows, width): a plain step at width 0 (`step_ms`), the widest
           pass at the block's width (`pass_ms`), linear in the verified tokens between;
           rows interpolate linearly between the given row counts (calls run padded to
           the engine's row buckets, so the bucket's rows are what it costs)
  prefill  prefill_ms[0] + prefill_ms[1] x (rows x chunk) / 1,000 tokens (padded shape)

A pass accepts each next draft with probability `alpha` (one value, or one per draft
slot) and emits accepted + 1 tokens, cut by the request's budget; a call stops early
once each of its rows is done, as the device's loop does. Tokens cycle through
`vocabulary` (ordinary text for the server's detokenizer), never an EOS.

Shape legend: S slots, R rows of a decode call, G rows of a prefill call, T chunk.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import types

import numpy as np

from dspine_jax.runtime import rows as row_fields
from dspine_jax.runtime.slot_steps import news_width
from dspine_jax.speculative.policy import SpeculationConfig, SpeculationPolicy
from pallas_kernels.switches import Switches


def parse_curve(text: str) -> dict[int, float]:
    """"1:1.03,64:2.45" -> {rows: ms}."""
    curve = {}
    for item in text.split(","):
        rows, ms = item.split(":")
        curve[int(rows)] = float(ms)
    if not curve or min(curve) < 1 or min(curve.values()) <= 0:
        raise ValueError(f"a cost curve is rows:ms pairs with rows >= 1 and ms > 0, "
                         f"got {text!r}")
    return dict(sorted(curve.items()))


def interpolate(curve: dict[int, float], rows: int) -> float:
    xs = list(curve)
    return float(np.interp(rows, xs, [curve[x] for x in xs]))


@dataclasses.dataclass(frozen=True)
class DeviceCosts:
    step_ms: dict[int, float]                 # a plain (width 0 / AR) step, by rows
    pass_ms: dict[int, float] | None = None   # a pass verifying the whole block, by rows
    prefill_ms: tuple[float, float] = (1.0, 1.0)   # per call, per 1,000 padded tokens
    block_size: int = 16

    def decode(self, rows: int, width: int | None) -> float:
        """Seconds of one pass over `rows` rows verifying `width` drafts (None: AR)."""
        step = interpolate(self.step_ms, rows)
        if not width or self.pass_ms is None:
            return step / 1e3
        widest = interpolate(self.pass_ms, rows)
        return (step + (widest - step) * width / (self.block_size - 1)) / 1e3

    def prefill(self, rows: int, chunk: int) -> float:
        base, per_1k = self.prefill_ms
        return (base + per_1k * rows * chunk / 1e3) / 1e3


class SimulatedSteps:
    """`slot_steps.CompiledSteps`' interface over a device that waits: every program is
    ready at once; a call sleeps its cost (the GIL released, as during a device call)
    and returns its news as the compiled call would."""

    def __init__(self, decoder: "SimulatedDecoder"):
        self.decoder = decoder
        self.params = ()
        self.switches = decoder.switches
        self.compiles = self.loaded = self.compiling = 0
        self.timings: list = []
        self.on_ready = None
        self.compile_seconds = 0.0
        s = decoder.num_slots
        self._generated = np.zeros(s + 1, np.int64)
        self._budget = np.zeros(s + 1, np.int64)
        self._done = np.ones(s + 1, bool)
        self._rng = np.random.default_rng(decoder.seed)
        self._cursor = 0

    # ----- what the runner and the engine core ask of compiled steps -------------------
    def compiled(self, name, key) -> bool:
        return True

    def pending(self, name, key) -> bool:
        return False

    def precompile(self, calls, workers=None) -> None:
        pass

    def compile_later(self, calls, workers=None) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(0.0)
        return done

    def cancel_background(self) -> None:
        pass

    def compiling_within(self, start: float, end: float) -> float:
        return 0.0

    def __call__(self, name: str, key, params, state, page_table, matrix, *inputs,
                 mode: str = "filtered", width: int | None = None):
        rows = np.asarray(matrix)
        if name == "prefill":
            return state, self._prefill(rows)
        return state, self._decode(rows, int(np.asarray(inputs[0])), width)

    # ----- the device ------------------------------------------------------------------
    def _tokens(self, n: int) -> list[int]:
        vocab = self.decoder.vocabulary
        out = [vocab[(self._cursor + i) % len(vocab)] for i in range(n)]
        self._cursor += n
        return out

    def _news(self, count: int) -> np.ndarray:
        width, passes = news_width(self.decoder)
        return np.zeros((count, 3 + width + passes), np.int32)

    def _prefill(self, rows: np.ndarray) -> np.ndarray:
        fields = row_fields.PREFILL_FIELDS
        col = {f: rows[:, i] for i, f in enumerate(fields)}
        g, chunk = rows.shape[0], rows.shape[1] - len(fields)
        time.sleep(self.decoder.costs.prefill(g, chunk))
        news = self._news(g)
        s = self.decoder.num_slots
        for i in range(g):
            slot = int(col["start_slot"][i])
            if slot >= s:
                continue
            resumed = int(col["resume_token"][i]) >= 0
            self._budget[slot] = int(col["budget"][i])
            self._generated[slot] = int(col["resume_count"][i]) if resumed else 0
            self._done[slot] = False
            if not resumed:             # a fresh request's first token
                news[i, 0] = 1
                news[i, 3] = self._tokens(1)[0]
                self._generated[slot] += 1
            self._done[slot] = self._generated[slot] >= self._budget[slot]
            news[i, 2] = self._done[slot]
        return news

    def _accepted(self, width: int) -> int:
        """Drafts one pass accepts of `width` (the chain stops at the first miss)."""
        alpha = self.decoder.alpha
        k = 0
        while k < width and self._rng.random() < alpha[min(k, len(alpha) - 1)]:
            k += 1
        return k

    def _decode(self, rows: np.ndarray, passes: int, width: int | None) -> np.ndarray:
        s = self.decoder.num_slots
        slots = rows[:, 0]
        passes = min(passes, self.decoder.steps_per_call)
        width_tokens, _ = news_width(self.decoder)
        news = self._news(rows.shape[0])
        live = [i for i, slot in enumerate(slots) if slot < s and not self._done[slot]]
        gained: dict[int, list[int]] = {i: [] for i in live}
        lengths: dict[int, list[int]] = {i: [] for i in live}
        ran = 0
        for _ in range(passes):
            if not live:
                break        # the device's loop ends once every row is done
            ran += 1
            for i in list(live):
                slot = slots[i]
                n = 1 if width is None else self._accepted(width) + 1
                n = min(n, self._budget[slot] - self._generated[slot])
                gained[i] += self._tokens(n)
                lengths[i].append(n)
                self._generated[slot] += n
                if self._generated[slot] >= self._budget[slot]:
                    self._done[slot] = True
                    live.remove(i)
        time.sleep(ran * self.decoder.costs.decode(rows.shape[0], width))
        for i, tokens in gained.items():
            news[i, 0], news[i, 1], news[i, 2] = len(tokens), len(lengths[i]), \
                self._done[slots[i]]
            news[i, 3:3 + len(tokens)] = tokens
            news[i, 3 + width_tokens:3 + width_tokens + len(lengths[i])] = lengths[i]
        return news


class SimulatedDecoder:
    """What `EngineCore` reads of a decoder, for AR (`alpha` None) or a drafter of
    `block_size` with speculation `speculation`, over `SimulatedSteps`."""

    dtype = np.float32

    def __init__(self, costs: DeviceCosts, *, num_slots: int, vocabulary: list[int],
                 alpha: list[float] | None = None, steps_per_call: int = 16,
                 shared_steps_per_call: int = 4,
                 speculation: SpeculationConfig = SpeculationConfig(),
                 vocab_size: int = 49152, context: int = 8192, page_size: int = 16,
                 seed: int = 0):
        self.costs, self.num_slots, self.vocabulary, self.seed = costs, num_slots, \
            vocabulary, seed
        self.alpha = alpha
        self.steps_per_call = steps_per_call
        self.shared_steps_per_call = min(shared_steps_per_call, steps_per_call)
        self.page_size = page_size
        self.config = types.SimpleNamespace(vocab_size=vocab_size,
                                            max_position_embeddings=context)
        self.eos = np.asarray([-1], np.int32)
        self.switches = Switches()
        self.attention = types.SimpleNamespace(name="simulated")
        self.layer_kernels = None
        if alpha is None:
            self.extra_capacity, self.speculation, self.widths, self.policy = 0, None, (), None
        else:
            block = costs.block_size
            self.extra_capacity = block
            self.speculation = speculation
            self.widths = speculation.widths(block)
            self.drafter_config = types.SimpleNamespace(kind="dspine", block_size=block)
            self.policy = SpeculationPolicy(speculation, block)
        self._slot_steps = SimulatedSteps(self)

    @property
    def pass_positions(self) -> int:
        return max(1, self.extra_capacity)

    @property
    def call_lookahead(self) -> int:
        return self.steps_per_call * self.pass_positions

    def default_width(self) -> int | None:
        return self.widths[-1] if self.widths else None

    def speculation_policy(self):
        return self.policy if len(self.widths) > 1 else None

    def finished_batch(self) -> None:
        pass

    def create_caches(self, page_table, num_pages: int) -> tuple:
        return ()

    def empty_state(self, caches: tuple, out_len: int):
        return None
