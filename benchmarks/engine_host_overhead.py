"""Where the time of one serving engine step goes: host work against device work.

  python -m dspine_benchmarks.engine_host_overhead                       # CPU, tiny model
  python -m dspine_benchmarks.engine_host_overhead --target smollm2-135m-instruct \\
      --drafter smollm2-135m-instruct-dspine --drafter smollm2-135m-instruct-dflash \\
      --prompts prompts.jsonl --slots 32 64 --out host.json                 # GPU

An `EngineCore` (the server's, without HTTP) keeps all of its --slots slots busy in a
closed loop, as `dspine bench serve` does at concurrency = slots: every request decodes
exactly --max-tokens tokens (EOS ignored, T = 0) after a prompt (--prompts cycled, else
random ids of --prompt-len; acceptance needs real text), and a finished one is replaced
at once by a new one. The first wave's budgets are staggered so that requests finish (and
are admitted, prefilled) a few at a time in every step, as under a steady load. Every call
shape is compiled first as `dspine serve` does (--compile-all, the default off the CPU;
on the CPU the warm-up steps compile what the loop uses). After --warmup-steps steps (a
step that still compiles is left out of the figures), --steps steps are timed, each split
into

  grow / admit      page growth, preemption, admission (host)
  prefill / decode  building a call's arguments and uploading them (host)
  collect           reading the new tokens back and the per-row bookkeeping (host)
  other             the rest of `step()` (host)
  dispatch          the compiled calls until they return (flattening the arguments,
                    launching); on a GPU that is host time, on the CPU it also holds
                    whatever part of the call XLA runs inline on the calling thread
  device            waiting for the calls to finish: each call is waited for right after
                    its dispatch (block_until_ready), so no host span hides device time;
                    also split into the prefill calls' and the decode calls' share
  fetch             the step's device-to-host transfers (jax.device_get)

host = step - dispatch - device - fetch, the sum of the host spans; `host/row` divides it
by the rows that decode in the step; tok/st counts the tokens the step emitted. The extra
syncs serialise little: the engine waits for its calls every step anyway. So a step here
is what the server's engine thread spends per step, less the HTTP side (detokenizing,
SSE, the event loop), which shares the GIL with it and is not measured here.

--target tiny (the default) is a random Llama of width 64 (the tests' shape) with
--tiny-layers layers (2; 30 gives SmolLM2's number of weight arrays, which each call
passes) and --drafter tiny-dspine / tiny-dflash a random 1-layer drafter of block 4: on
the CPU their device time is small, so the host work shows. Drafters are also names or
folders (the shipped ones: smollm2-135m-instruct-dspine, -dflash); AR runs unless
--skip-ar.
--cprofile N prints each method's N most expensive Python functions over extra steps.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import platform
import pstats
import statistics
import time
from datetime import date

SPANS = ("grow", "admit", "prefill", "decode", "collect")   # the core's host phases
CALLS = ("dispatch", "device", "fetch")   # time inside the phases that is not their own
TINY_DRAFTERS = ("tiny-dspine", "tiny-dflash")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default="tiny", help="tiny, a name, a path or preset:NAME")
    p.add_argument("--tiny-layers", type=int, default=2,
                   help="layers of --target tiny (30: SmolLM2's count of weight arrays)")
    p.add_argument("--drafter", action="append", default=None,
                   help="repeatable; tiny-dspine, tiny-dflash, a name or a folder "
                        "(default: tiny-dspine with --target tiny, else none)")
    p.add_argument("--skip-ar", action="store_true")
    p.add_argument("--slots", type=int, nargs="+", default=[32])
    p.add_argument("--prompts", default=None,
                   help="JSONL {prompt, chat} (a target with a tokenizer) or {token_ids}, "
                        "cycled (default: random ids)")
    p.add_argument("--num-prompts", type=int, default=64, help="of --prompts")
    p.add_argument("--prompt-len", type=int, default=32, help="of the random prompts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: 256 for tiny, else min(context, 2048) as dspine serve")
    p.add_argument("--steps-per-call", type=int, default=None,
                   help="default: the pipeline's (AR 8, speculative 4)")
    p.add_argument("--warmup-steps", type=int, default=12)
    p.add_argument("--compile-all", action=argparse.BooleanOptionalAction, default=None,
                   help="compile every call shape first (default: off the CPU only)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also print the N most expensive functions (extra steps)")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    return p.parse_args(argv)


# ----- the models ------------------------------------------------------------------------
def tiny_target(dtype, layers: int):
    from flax import nnx

    from dspine_jax.checkpoints import resolve_dtype
    from dspine_jax.config import TargetConfig
    from dspine_jax.target import TargetModel

    config = TargetConfig(family="llama", vocab_size=320, hidden_size=64,
                          intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                          rope_theta=1e5, tie_word_embeddings=True)
    return TargetModel(config, dtype=resolve_dtype(dtype), rngs=nnx.Rngs(0))


def load_model(name: str, dtype: str, tiny_layers: int = 2):
    """(model, eos ids, tokenizer). A preset or tiny target has no tokenizer: no EOS (it
    is ignored anyway)."""
    from dspine_jax.checkpoints import load_target

    if name == "tiny":
        return tiny_target(dtype, tiny_layers), (), None
    loaded = load_target(name, dtype=dtype)
    tokenizer = loaded.tokenizer
    return loaded.model, tokenizer.eos_token_ids if tokenizer is not None else (), tokenizer


def make_decoder(model, eos, drafter: str | None, steps_per_call: int | None):
    from dspine_jax.engine import SpeculativeEngine
    from dspine_jax.generate import AutoregressiveGenerator

    if drafter is None:
        return AutoregressiveGenerator(model, eos_token_ids=eos,
                                       steps_per_call=steps_per_call or 8)
    return SpeculativeEngine(model, load_drafter(drafter, model), eos_token_ids=eos,
                             steps_per_call=steps_per_call or 4)


def load_drafter(name: str, model):
    from dspine_jax.drafters.checkpoint import load_drafter as load
    from dspine_jax.drafters.config import DrafterConfig
    from dspine_jax.drafters.model import BlockDrafter
    from dspine_jax.registry import resolve_drafter

    if name in TINY_DRAFTERS:
        config = DrafterConfig.for_target(model.config, kind=name.split("-")[1], num_layers=1,
                                          mask_token_id=0, block_size=4)
        return BlockDrafter.create(config, model.output_embedding(), seed=1, dtype=model.dtype)
    return load(resolve_drafter(name), dtype=model.dtype)


# ----- the timed engine --------------------------------------------------------------------
class Timer:
    """Per-step sums of named spans, filled by wrappers around the core's methods; call
    and transfer time is also filed under the phase (SPANS) running it."""

    def __init__(self):
        self.step: dict[str, float] = {}
        self.phase: list[str] = []

    def add(self, name: str, seconds: float) -> None:
        self.step[name] = self.step.get(name, 0.0) + seconds
        if name in CALLS and self.phase:
            key = f"{self.phase[-1]}.{name}"
            self.step[key] = self.step.get(key, 0.0) + seconds

    def wrap(self, fn, name: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.phase.append(name)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase.pop()
                self.add(name, time.perf_counter() - t0)
        return timed


class SyncedSteps:
    """The core's compiled calls, each waited for after its dispatch: its device time is
    then a span of its own ("device"), out of the host spans that dispatched it."""

    def __init__(self, steps, timer: Timer):
        self._steps, self._timer = steps, timer

    def __getattr__(self, name):
        return getattr(self._steps, name)

    def __call__(self, *args, **kwargs):
        import jax

        t0 = time.perf_counter()
        out = self._steps(*args, **kwargs)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        self._timer.add("dispatch", t1 - t0)
        self._timer.add("device", time.perf_counter() - t1)
        return out


def instrument(core, timer: Timer):
    """Time the core's phases, its calls' device time and its transfers (jax.device_get)."""
    import jax

    for name in SPANS:
        setattr(core, f"_{name}", timer.wrap(getattr(core, f"_{name}"), name))
    core._steps = SyncedSteps(core._steps, timer)
    jax.device_get = timer.wrap(jax.device_get, "fetch")


class ClosedLoop:
    """Keeps every slot busy: a finished request is replaced before the next step. The
    prompts are cycled."""

    def __init__(self, core, slots: int, prompts: list[list[int]], max_tokens: int):
        from dspine_serve.engine_core import SamplingOptions

        self.core, self.options = core, SamplingOptions
        self.max_tokens = max_tokens
        self.prompts = [p for p in prompts if self.fits(p)]
        if not self.prompts:
            raise SystemExit("no prompt leaves room for --max-tokens in --max-model-len")
        self.count = 0
        for i in range(slots):     # staggered first wave: a few finish in every step
            self.add(max(1, (i + 1) * max_tokens // slots))

    def fits(self, prompt: list[int]) -> bool:
        from dspine_jax.errors import InputError

        try:
            self.core.check_request(prompt, self.options(max_tokens=self.max_tokens))
        except InputError:
            return False
        return True

    def add(self, budget: int) -> None:
        prompt = self.prompts[self.count % len(self.prompts)]
        self.core.add_request(f"r{self.count}", prompt, self.options(
            max_tokens=budget, temperature=0.0, ignore_eos=True, seed=self.count))
        self.count += 1

    def step(self) -> tuple[float, int, int]:
        """One engine step; (its seconds, tokens emitted, requests finished)."""
        t0 = time.perf_counter()
        outputs = self.core.step()
        seconds = time.perf_counter() - t0
        finished = sum(o.finished for o in outputs)
        for _ in range(finished):
            self.add(self.max_tokens)
        return seconds, sum(len(o.new_token_ids) for o in outputs), finished


def decoding_rows(core) -> int:
    return sum(r.decoding for r in core._running.values())


def measure(core, loop: ClosedLoop, timer: Timer, steps: int) -> list[dict]:
    rows = []
    compiled = core._steps._executables
    for _ in range(steps):
        before, rows_in = len(compiled), decoding_rows(core)
        timer.step = {}
        total, tokens, finished = loop.step()
        if len(compiled) != before:
            rows.append({"compiled": True})
            continue
        rows.append(dict(timer.step, step=total, tokens=tokens, finished=finished,
                         rows=rows_in))
    return rows


def summarise(rows: list[dict]) -> dict:
    """Means over the steps that compiled nothing: ms per step, us per decoding row."""
    good = [r for r in rows if not r.get("compiled")]
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in good)  # noqa: E731
    step, rows_mean = mean("step"), mean("rows")
    host = step - sum(mean(c) for c in CALLS)
    out = {"steps": len(good), "compiled_steps": len(rows) - len(good),
           "rows": round(rows_mean, 1), "tokens_per_step": round(mean("tokens"), 1),
           "finished_per_step": round(mean("finished"), 2), "step_ms": step * 1e3,
           **{f"{c}_ms": mean(c) * 1e3 for c in CALLS}, "host_ms": host * 1e3,
           "host_us_per_row": host * 1e6 / max(rows_mean, 1)}
    for name in SPANS:   # a phase's own host time: less the calls and transfers inside it
        inside = sum(mean(f"{name}.{c}") for c in CALLS)
        out[f"{name}_ms"] = (mean(name) - inside) * 1e3
    for name in ("prefill", "decode"):
        out[f"{name}_device_ms"] = mean(f"{name}.device") * 1e3
    out["other_ms"] = out["host_ms"] - sum(out[f"{n}_ms"] for n in SPANS)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def read_prompts(args, tokenizer, vocab: int) -> list[list[int]]:
    """--prompts (text through the target's tokenizer), else 64 prompts of --prompt-len
    random ids."""
    import numpy as np

    if args.prompts is None:
        rng = np.random.default_rng(0)
        return [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(64)]
    from dspine_benchmarks.loop_vs_engine import read_prompts as read

    return read(args.prompts, tokenizer, args.num_prompts)


def run_one(model, eos, drafter, slots: int, prompts, args) -> dict:
    import jax

    from dspine_serve.engine_core import EngineCore

    decoder = make_decoder(model, eos, drafter, args.steps_per_call)
    context = model.config.max_position_embeddings
    max_len = args.max_model_len or (256 if args.target == "tiny" else min(context, 2048))
    core = EngineCore(decoder, max_slots=slots, max_model_len=max_len)
    t0 = time.perf_counter()
    compile_all = args.compile_all
    if compile_all or (compile_all is None and jax.default_backend() != "cpu"):
        core.warmup()
    device_get = jax.device_get
    timer = Timer()
    instrument(core, timer)
    try:
        loop = ClosedLoop(core, slots, prompts, args.max_tokens)
        measure(core, loop, timer, args.warmup_steps)
        warmup = time.perf_counter() - t0
        result = summarise(measure(core, loop, timer, args.steps))
        if args.cprofile:
            result["cprofile"] = profile(loop, args.steps, args.cprofile)
    finally:
        jax.device_get = device_get
    method = "ar" if drafter is None else drafter
    return {"method": method, "slots": slots, "steps_per_call": decoder.steps_per_call,
            "max_model_len": max_len, "warmup_s": round(warmup, 1), **result}


def profile(loop: ClosedLoop, steps: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        loop.step()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


COLUMNS = [("method", "{:>14}"), ("slots", "{:>5}"), ("rows", "{:>5}"),
           ("tokens_per_step", "{:>7}"), ("step_ms", "{:>8.2f}"), ("dispatch_ms", "{:>8.2f}"),
           ("device_ms", "{:>8.2f}"), ("prefill_device_ms", "{:>6.2f}"),
           ("decode_device_ms", "{:>7.2f}"), ("fetch_ms", "{:>7.2f}"), ("host_ms", "{:>7.2f}"),
           ("host_us_per_row", "{:>8.1f}"),
           ("grow_ms", "{:>6.2f}"), ("admit_ms", "{:>6.2f}"), ("prefill_ms", "{:>7.2f}"),
           ("decode_ms", "{:>6.2f}"), ("collect_ms", "{:>7.2f}"), ("other_ms", "{:>6.2f}")]
HEAD = ["method", "slots", "rows", "tok/st", "step ms", "dispatch", "dev ms", "dev pf",
        "dev dec", "fetch", "host ms",
        "host/row", "grow", "admit", "prefill", "decode", "collect", "other"]


def table(rows: list[dict]) -> str:
    widths = [len(fmt.format(rows[0][key])) if rows else 8 for key, fmt in COLUMNS]
    lines = ["  ".join(h.rjust(w) for h, w in zip(HEAD, widths))]
    lines += ["  ".join(fmt.format(r[key]) for key, fmt in COLUMNS) for r in rows]
    return "\n".join(lines) + ("\n(ms per step; host/row in us; host = step - dispatch - "
                                "dev - fetch; dev pf / dev dec: the prefill / decode calls' "
                                "share of dev)")


def main(argv=None):
    args = parse_args(argv)
    import jax

    drafters = args.drafter
    if drafters is None:
        drafters = ["tiny-dspine"] if args.target == "tiny" else []
    methods = ([] if args.skip_ar else [None]) + drafters
    model, eos, tokenizer = load_model(args.target, args.dtype, args.tiny_layers)
    prompts = read_prompts(args, tokenizer, model.config.vocab_size)
    rows = []
    for slots in args.slots:
        for drafter in methods:
            row = run_one(model, eos, drafter, slots, prompts, args)
            rows.append(row)
            print(f"{row['method']} slots={slots}: {row['steps']} steps "
                  f"(warm-up {row['warmup_s']}s)", flush=True)
            if "cprofile" in row:
                print(row["cprofile"])
    print(table(rows))
    if args.out:
        meta = {"date": date.today().isoformat(), "backend": jax.default_backend(),
                "device": str(jax.devices()[0]), "host": platform.processor()
                or platform.machine(), "target": args.target, "prompts": args.prompts,
                "prompt_len": args.prompt_len, "max_tokens": args.max_tokens}
        with open(args.out, "w") as f:
            json.dump({**meta, "rows": [{k: v for k, v in r.items() if k != "cprofile"}
                                        for r in rows]}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
