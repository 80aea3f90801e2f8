"""Adaptive speculation: how many drafted tokens the target verifies in the next call.

A pass that verifies the first k drafts (k from a small compiled set; k = 0 is a plain AR
step that skips the drafter) emits, per row, in expectation

    E_k = 1 + sum_{j <= k} prod_{i <= j} alpha_i

tokens, alpha_i being the row's rate of accepting slot i once slots 1 .. i-1 were accepted
(`acceptance.expected_tokens`), and costs c(B, k) seconds for the whole batch of B rows.
The policy verifies the width that maximises sum over rows of E_k / c(B, k): wide blocks
where passes are cheap (a GPU at small batch: a pass reads the weights once however many
tokens it verifies), narrow ones or none where each verified token costs compute (a CPU,
large batches). Verification is exact for every k (the rule on a prefix of the block is
the same rule), so the choice changes speed, never the output's distribution; at T = 0 the
tokens are the same for every k.

Both inputs are measured as decoding runs, host-side, with no device work of their own:
  AcceptanceStats  per row (a request), decayed counts of slots reached and accepted,
                   with the pool of every row seen as the prior of a new one
  CostTable        seconds per pass by (batch, width): the median of each width's latest
                   calls (the device's busy time, `runtime.runner`), so one slow call
                   moves nothing; a width not yet run is estimated from those run
                   (`CostTable.estimate`: a pass costs a plain step, a fixed part and a
                   part per verified draft)
The first calls of a batch shape run the widest width, then a plain step, a few calls
each, to measure both ends; then the policy re-runs the end it has not run lately every
`probe_every` calls or, where running it gives up much throughput, as seldom as keeps
that loss under `probe_budget` (but at least every `probe_max` calls), so the acceptance
of deep slots and the cost of the other end stay current. A call whose time contradicts
its width's cost is repeated at once, so a cost measured wrong (a first run, another
process compiling) is replaced within a few calls instead of steering the choice. The
costs and the pooled acceptance are saved in a small JSON file per device, target and
drafter (`save`/`load`), so a new process starts where the last one stopped instead of
measuring again; a plain step's cost from the file is still re-timed once, on the second
call, when the policy picked a wider width: a table measured under other conditions then
cannot keep the policy speculating where it decodes slower than AR.

Seeds: a sampled (T > 0) output follows the target's distribution under every width, but
which sample a seed gives depends on the widths run, and the adaptive widths depend on
timings; so a call with a seeded sampled row runs the widest width (`Scheduler._width`:
an offline prompt is seeded when the run gives a seed, a served request when it does),
and the policy chooses for greedy rows and unseeded sampled ones.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import statistics
from pathlib import Path

from dspine_jax.errors import InputError

MODES = ("adaptive", "fixed", "off")
DEFAULT_MODE = "adaptive"
# Verify widths the adaptive policy compiles: the block's anchor plus k drafts makes
# 1, 2, 4, 8, 16 verified tokens, shapes every attention kernel tiles well.
ADAPTIVE_WIDTHS = (0, 1, 3, 7, 15)
# A pass costs a plain step plus a part fixed per pass (the draft, its proposals, the
# acceptance) plus a part per verified draft. On an H100 at 32 and 64 rows and on a 2-core
# CPU the fixed part was 36-39% of what the whole block costs over a plain step; a width
# narrower than every pass width run is estimated with that split.
PASS_FIXED_SHARE = 0.4


@dataclasses.dataclass(frozen=True)
class SpeculationConfig:
    """mode: adaptive (the width per call from measured costs and acceptance), fixed (every
    pass verifies `max_verify_width` drafts) or off (every pass a plain AR step: the
    drafter runs only to keep its context). max_verify_width: at most this many drafts
    verified per pass; None is the drafter's whole block (block size - 1)."""
    mode: str = DEFAULT_MODE
    max_verify_width: int | None = None

    def validate(self, block_size: int | None = None) -> None:
        if self.mode not in MODES:
            raise InputError(f"--speculation must be one of {', '.join(MODES)}; "
                             f"got {self.mode!r}")
        w = self.max_verify_width
        if w is None:
            return
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise InputError(f"--max-verify-width must be a non-negative integer, got {w!r}")
        if w == 0 and self.mode == "fixed":
            raise InputError("--max-verify-width 0 with --speculation fixed verifies no "
                             "draft: that is AR decoding (--method ar, or --speculation off)")
        if block_size is not None and w > block_size - 1:
            raise InputError(f"--max-verify-width {w} is more than the drafter drafts: its "
                             f"block of {block_size} tokens holds {block_size - 1} drafts")

    def widths(self, block_size: int) -> tuple[int, ...]:
        """The verify widths this mode may run, ascending (each is one compiled program)."""
        top = block_size - 1 if self.max_verify_width is None else self.max_verify_width
        if self.mode == "off":
            return (0,)
        if self.mode == "fixed":
            return (top,)
        return tuple(sorted({w for w in ADAPTIVE_WIDTHS if w < top} | {top}))

    def to_json(self) -> dict:
        return {"speculation": self.mode, "max_verify_width": self.max_verify_width}


def expected_tokens(alpha: list[float], width: int) -> float:
    """E_width = 1 + sum_{j <= width} prod_{i <= j} alpha_i (host floats)."""
    total, run = 1.0, 1.0
    for a in alpha[:width]:
        run *= a
        total += run
    return total


def slot_acceptance(kept: list[int], slots: int) -> list[float]:
    """The per-slot acceptance profile of passes that each verified `slots` drafts and kept
    the first kept[p]: alpha_i = P(kept >= i) / P(kept >= i - 1), so expected_tokens of
    it at `slots` is 1 + mean(kept). A slot never reached takes its predecessor's rate."""
    reach = [sum(k >= i for k in kept) for i in range(slots + 1)]
    alpha, last = [], 0.0
    for i in range(1, slots + 1):
        last = reach[i] / reach[i - 1] if reach[i - 1] else last
        alpha.append(last)
    return alpha


class AcceptanceStats:
    """Decayed counts per drafted slot i (1-based): passes that verified slot i with every
    earlier slot accepted ("reached"), and those that kept it. alpha_i = kept / reached,
    pulled towards `prior` (weight `prior_weight` passes) while few passes are seen.

    The engine observes every pass of every row on its host thread, so a pass costs only
    the slots it touched: the decay of all counts is one running factor (counts are kept
    in units of it and rescaled once it grows large), and alpha is cached until the next
    observation."""

    def __init__(self, slots: int, *, decay: float = 0.98, prior: list[float] | None = None,
                 prior_weight: float = 2.0):
        self.slots, self.decay, self.prior_weight = slots, decay, prior_weight
        self.prior = list(prior) if prior is not None else [0.5] * slots
        # the counts are _reached[i] * _unit (likewise kept); a pass multiplies _unit by
        # `decay` (every count decays) and adds 1 / _unit to the slots it touched
        self._reached = [0.0] * slots
        self._kept = [0.0] * slots
        self._unit = 1.0
        self._alpha = None

    @property
    def reached(self) -> list[float]:
        return [r * self._unit for r in self._reached]

    @property
    def kept(self) -> list[float]:
        return [k * self._unit for k in self._kept]

    def observe(self, width: int, accepted: int) -> None:
        """One pass that verified `width` drafts and kept the first `accepted`."""
        if width == 0:
            return
        self._unit *= self.decay
        if self._unit < 1e-100:        # rescale before 1 / unit overflows
            self._reached, self._kept = self.reached, self.kept
            self._unit = 1.0
        one = 1.0 / self._unit
        for i in range(min(accepted + 1, width, self.slots)):  # slots 1 .. accepted + 1 tried
            self._reached[i] += one
        for i in range(min(accepted, width, self.slots)):
            self._kept[i] += one
        self._alpha = None

    def alpha(self) -> list[float]:
        if self._alpha is None:
            w, unit = self.prior_weight, self._unit
            self._alpha = [(k * unit + w * p) / (r * unit + w) if r * unit + w > 0 else p
                           for k, r, p in zip(self._kept, self._reached, self.prior)]
        return self._alpha

    def set_prior(self, prior: list[float]) -> None:
        self.prior = list(prior)
        self._alpha = None

    def expected_tokens(self, width: int) -> float:
        return expected_tokens(self.alpha(), width)


class CostTable:
    """Seconds per pass by (batch rows, verify width): the median of the latest `window`
    calls. The policy trusts a width's cost for its choice of what to measure once
    `min_samples` calls are in (`trusted`), so one slow call (a program's first run on the
    device, a host stall, another process compiling) cannot settle it. A width not yet run
    at a batch is estimated from the widths run there (`estimate`)."""

    def __init__(self, window: int = 5, min_samples: int = 3):
        self.window, self.min_samples = window, min_samples
        self.samples: dict[tuple[int, int], collections.deque] = {}

    def observe(self, rows: int, width: int, seconds_per_pass: float) -> None:
        key = (rows, width)
        if key not in self.samples:
            self.samples[key] = collections.deque(maxlen=self.window)
        self.samples[key].append(seconds_per_pass)

    def set(self, rows: int, width: int, seconds_per_pass: float) -> None:
        """A cost measured on purpose (a file, `dspine info --speculation-costs`): it counts
        as `min_samples` calls, so it is trusted at once and live calls can replace it."""
        self.samples[(rows, width)] = collections.deque([seconds_per_pass] * self.min_samples,
                                                        maxlen=self.window)

    @property
    def seconds(self) -> dict[tuple[int, int], float]:
        return {k: statistics.median(v) for k, v in self.samples.items() if v}

    def trusted(self, rows: int) -> set[int]:
        """The widths at `rows` with at least `min_samples` calls."""
        return {w for (r, w), v in self.samples.items()
                if r == rows and len(v) >= self.min_samples}

    def measured(self, rows: int) -> dict[int, float]:
        """The medians at `rows` (asked for every width of every call: only that batch's)."""
        return {w: statistics.median(v) for (r, w), v in self.samples.items()
                if r == rows and v}

    def estimate(self, rows: int, width: int) -> float | None:
        """Seconds per pass of `width` drafts at `rows` rows: its median where it ran, else
        from the widths that ran. Pass widths are affine in the drafts they verify, so a
        width between two that ran is interpolated between them. A narrower one is not
        interpolated towards the plain step (width 0): a pass also pays a fixed part that
        a plain step does not (on a 2-core CPU one verified draft cost 2.4 plain steps,
        the whole block 4.5), and a line through the plain step made narrow widths look
        cheap enough to try, each try a call or two of passes that decode slower than AR.
        It goes down from the narrowest pass width run by the slope between the two
        narrowest, or, where one ran, by the per-draft part of its cost over a plain step
        (1 - PASS_FIXED_SHARE of it); never below a plain step. A width wider than every
        one run is held at the widest; None where nothing ran at `rows`."""
        known = self.measured(rows)
        if width in known:
            return known[width]
        if not known:
            return None
        passes = sorted(w for w in known if w > 0)
        if width == 0 or not passes:        # the nearest width that ran
            return known[min(known, key=lambda w: (abs(w - width), w))]
        above = [w for w in passes if w > width]
        below = [w for w in passes if w < width]
        if below and above:
            lo, hi = max(below), min(above)
            return known[lo] + (width - lo) / (hi - lo) * (known[hi] - known[lo])
        if below:
            return known[max(below)]
        narrowest = passes[0]
        if len(passes) >= 2:
            nxt = passes[1]
            slope = max(0.0, (known[nxt] - known[narrowest]) / (nxt - narrowest))
        elif 0 in known:
            slope = max(0.0, (1 - PASS_FIXED_SHARE) * (known[narrowest] - known[0])
                        / narrowest)
        else:
            slope = 0.0
        cost = known[narrowest] - slope * (narrowest - width)
        return max(cost, known[0]) if 0 in known else cost

    def rows(self) -> list[int]:
        return sorted({r for r, _ in self.seconds})

    def surprised(self, rows: int, width: int, seconds_per_pass: float,
                  margin: float = 0.25) -> bool:
        """Whether a new sample is more than `margin` off the trusted median."""
        samples = self.samples.get((rows, width), ())
        if len(samples) < self.min_samples:
            return False
        known = statistics.median(samples)
        return abs(seconds_per_pass - known) > margin * known


class SpeculationPolicy:
    """Picks each call's verify width; `observe_call` and `observe_pass` feed it."""

    def __init__(self, config: SpeculationConfig, block_size: int, *, probe_every: int = 16,
                 probe_budget: float = 0.01, probe_max: int = 256, tolerance: float = 0.05,
                 costs: CostTable | None = None):
        self.config = config
        self.slots = block_size - 1
        self.widths = config.widths(block_size)
        self.probe_every, self.probe_budget, self.probe_max = probe_every, probe_budget, probe_max
        self.tolerance = tolerance
        self.costs = costs or CostTable()
        self.pool = AcceptanceStats(self.slots, decay=0.995)   # every row: a new row's prior
        self.calls: dict[int, int] = {}                          # calls per batch size
        self.last_run: dict[tuple[int, int], int] = {}           # (rows, width) -> call
        # (rows, width) whose last call disagreed with its trusted cost: run again soon,
        # at most `min_samples` times in a row, until the median follows or the call agrees
        self.recheck: dict[tuple[int, int], int] = {}
        self.loaded: set[tuple[int, int]] = set()     # (rows, width) costs read from a file
        # (rows, width) run once on an estimated cost, its time not in yet
        self.pending: set[tuple[int, int]] = set()

    def new_row(self) -> AcceptanceStats:
        return AcceptanceStats(self.slots, prior=self.pool.alpha(), prior_weight=4.0)

    def observe_pass(self, stats: AcceptanceStats, width: int, accepted: int) -> None:
        stats.observe(width, accepted)
        self.pool.observe(width, accepted)

    def observe_call(self, rows: int, width: int, seconds: float, passes: int,
                     most: int | None = None) -> None:
        """A decode call's device seconds over the `passes` it ran, of the `most` it could
        run. A call cut short (every row finished) is a sample, but never a surprise: its
        call-fixed costs are spread over fewer passes (a last call of 6 passes on a 2-core
        CPU took 1.5x a full call's time per pass), and a recheck runs that width for
        several calls."""
        self.pending.discard((rows, width))
        if passes <= 0 or seconds <= 0:
            return
        key = (rows, width)
        if most is None or passes >= most:   # a call cut short leaves rechecks as they are
            if self.costs.surprised(rows, width, seconds / passes):
                self.recheck[key] = self.recheck.get(key, self.costs.min_samples)
            else:
                self.recheck.pop(key, None)
        self.costs.observe(rows, width, seconds / passes)

    def measuring(self, rows: int, widths: tuple[int, ...] | None = None) -> bool:
        """Whether the next call over `rows` rows runs an end of `widths` (default: the
        policy's) only to time it: an end not yet trusted at that batch size."""
        widths = widths or self.widths
        return len(widths) > 1 and self._end_to_time(rows, widths) is not None

    def _end_to_time(self, rows: int, widths: tuple[int, ...]) -> int | None:
        """The end of `widths` still to time at `rows` rows, the widest first; None once
        both are trusted."""
        trusted = self.costs.trusted(rows)
        return next((end for end in (widths[-1], widths[0]) if end not in trusted), None)

    def not_timed(self) -> None:
        """A decode call will not be timed (its program's first run, programs compiling
        beside it): a width guessed for it may be guessed again."""
        self.pending.clear()

    def scores(self, rows: int, active: list[AcceptanceStats]) -> dict[int, float]:
        """Expected tokens per second of each width for these rows (None where unknown)."""
        out = {}
        for w in self.widths:
            cost = self.costs.estimate(rows, w)
            if cost is not None:
                out[w] = sum(s.expected_tokens(w) for s in active) / max(cost, 1e-12)
        return out

    def pick(self, scores: dict[int, float]) -> int:
        """The widest width whose tokens/s is within the tolerance of the best: ties go
        to speculation."""
        best = max(scores.values())
        return max(w for w, s in scores.items() if s >= (1 - self.tolerance) * best)

    def choose(self, rows: int, active: list[AcceptanceStats],
               widths: tuple[int, ...] | None = None) -> int:
        """The width of the next call over a batch of `rows` rows, `active` the stats of
        the rows still decoding; `widths`: a subset of the policy's to choose from (the
        programs a caller compiled)."""
        widths = widths or self.widths
        if len(widths) == 1:
            return widths[0]
        call = self.calls.get(rows, 0)
        self.calls[rows] = call + 1
        lo, hi = widths[0], widths[-1]
        # measure both ends first, a few calls each: the widest (fixed speculation), then
        # a plain step; a middle width is then tried once where its estimated cost
        # makes it look best, and kept only if its measured cost does
        end = self._end_to_time(rows, widths)
        if end is not None:
            return self._ran(rows, end, call)
        # a width is tried on its estimated cost one at a time, and not again until
        # that call's time is in: times arrive a call or two late (steps are pipelined),
        # and a wrong guess must cost one call, not every call until its time arrives
        measured = self.costs.measured(rows)
        guessing = any(r == rows for r, _ in self.pending)
        scores = {w: s for w, s in self.scores(rows, active or [self.pool]).items()
                  if w in widths and (w in measured or not guessing)}
        width = self.pick(scores)
        # an end whose last call contradicted its cost is run again at once (a cost that
        # was measured wrong must not stick); else the end least recently run, to refresh
        # what the chosen width cannot see, as often as the throughput it gives up allows
        for end in (lo, hi):
            if end != width and self.recheck.get((rows, end), 0) > 0:
                self.recheck[(rows, end)] -= 1
                return self._ran(rows, end, call)
        end = min((lo, hi), key=lambda w: self.last_run.get((rows, w), -1))
        if end == lo != width and call >= 1 and (rows, lo) in self.loaded \
                and (rows, lo) not in self.last_run:
            # a plain step's cost read from a file is re-timed once in this process, early:
            # it may have been measured under other conditions (a loaded machine), and too
            # high a cost would keep a block that decodes slower than AR until the first
            # probe (too high a cost of the block only leaves speed unused until then)
            width = lo
        elif end != width:
            loss = max(0.0, 1 - scores[end] / scores[width])
            every = min(self.probe_max,
                        max(self.probe_every, math.ceil(loss / self.probe_budget)))
            if call - self.last_run.get((rows, end), -1) >= every:
                width = end
        if width not in measured:
            self.pending.add((rows, width))
        return self._ran(rows, width, call)

    # ----- kept between processes ----------------------------------------------------------
    def to_json(self) -> dict:
        return {"costs": [[r, w, s] for (r, w), s in sorted(self.costs.seconds.items())],
                "acceptance": self.pool.alpha()}

    def save(self, path: Path) -> None:
        """Write the measured costs and pooled acceptance (atomically: a reader never sees
        half a file)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.to_json()))
        os.replace(tmp, path)

    def load(self, path: Path) -> bool:
        """Start from a saved file's costs and acceptance (as a prior); a missing or
        unreadable file changes nothing. -> whether one was read."""
        try:
            saved = json.loads(Path(path).read_text())
            costs = {(int(r), int(w)): float(sec) for r, w, sec in saved["costs"]}
            alpha = [float(a) for a in saved["acceptance"]]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if len(alpha) != self.slots:
            return False
        for (rows, width), seconds in costs.items():
            if width in self.widths:
                self.costs.set(rows, width, seconds)
                self.loaded.add((rows, width))
        self.pool.set_prior(alpha)
        return True

    def _ran(self, rows: int, width: int, call: int) -> int:
        self.last_run[(rows, width)] = call
        return width
