"""The program store: a decoder's compiled programs kept whole on disk, run later without
tracing, under a key of everything their trace depends on."""

from __future__ import annotations

import logging
import os
import time

import jax
import jax.numpy as jnp
import pytest

from dspine_jax import compile_cache
from dspine_jax.engine import SpeculativeEngine
from dspine_jax.generate import AutoregressiveGenerator
from dspine_jax.program_store import SUFFIX, ProgramStore
from dspine_jax.runtime import slot_steps
from dspine_jax.runtime.engine_core import EngineConfig, EngineCore, SamplingOptions
from dspine_jax.runtime.offline import generate_tokens
from pallas_kernels.switches import Switches
from tests.test_engine import PROMPTS, build
from tests.test_warmup import serve

REQUESTS = [(PROMPTS[0], SamplingOptions(max_tokens=10, ignore_eos=True)),
            (PROMPTS[1], SamplingOptions(max_tokens=10, temperature=0.8, top_p=0.9, seed=3,
                                         ignore_eos=True))]


@pytest.fixture
def store(tmp_path, monkeypatch) -> ProgramStore:
    """The store on, in a folder of this test (JAX's own cache stays off)."""
    store = ProgramStore(tmp_path / "programs", max_bytes=1 << 30)
    monkeypatch.setattr(compile_cache, "_store", store)
    return store


@pytest.fixture
def traces(monkeypatch) -> list[str]:
    """The names of the engine programs traced from now on."""
    traced = []
    for name in ("prefill_rows", "decode_rows"):
        real = getattr(slot_steps, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            traced.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(slot_steps, name, counted)
    return traced


def run(engine, requests=REQUESTS):
    core = EngineCore(engine, EngineConfig(max_slots=2, max_model_len=64))
    tokens, _ = serve(core, requests)
    return tokens, slot_steps.compiled(engine)


def test_a_stored_program_runs_untraced_with_any_weights_of_its_shapes(store, traces):
    target, drafter = build(kind="dspine")
    first, steps = run(SpeculativeEngine(target, drafter, eos_token_ids=[0]))
    assert traces and steps.loaded == 0
    stored = sorted(store.folder.glob(f"*{SUFFIX}"))
    assert len(stored) == steps.compiles == len(set(traces))

    # a new decoder over the same weights: every program comes from the store
    traces.clear()
    again, steps = run(SpeculativeEngine(target, drafter, eos_token_ids=[0]))
    assert again == first
    assert traces == [] and steps.loaded == steps.compiles == len(stored)

    # other weights of the same shapes: the same programs, that decoder's own tokens
    other_target, other_drafter = build(kind="dspine", seed=5)
    other, steps = run(SpeculativeEngine(other_target, other_drafter, eos_token_ids=[0]))
    assert traces == [] and steps.loaded == steps.compiles
    ar = AutoregressiveGenerator(other_target, eos_token_ids=[0])
    want = generate_tokens(ar, [PROMPTS[0]], max_new_tokens=10, ignore_eos=True)
    assert other[0] == want.generations[0].tokens and other[0] != first[0]


def test_what_the_trace_depends_on_is_another_program(store, traces):
    target, drafter = build(kind="dspine")
    run(SpeculativeEngine(target, drafter, eos_token_ids=[0]), REQUESTS[:1])
    stored = len(list(store.folder.glob(f"*{SUFFIX}")))
    for changed in (dict(eos_token_ids=[0, 7]),                       # a closed-over array
                    dict(eos_token_ids=[0], steps_per_call=2),         # a runtime choice
                    dict(eos_token_ids=[0],                            # a kernel switch
                         switches=Switches.from_environment({"DSPINE_WARP_THRESHOLD": "search"}))):
        traces.clear()
        _, steps = run(SpeculativeEngine(target, drafter, **changed), REQUESTS[:1])
        assert steps.loaded == 0 and traces, changed
    assert len(list(store.folder.glob(f"*{SUFFIX}"))) == 4 * stored

    identity = SpeculativeEngine(target, drafter, eos_token_ids=[0]).program_identity()
    args = (jnp.zeros((2, 3)),)
    key = store.key(identity, "decode", args, {"mode": "greedy", "width": 4})
    assert key == store.key(dict(identity), "decode", args, {"mode": "greedy", "width": 4})
    assert key != store.key(identity, "decode", args, {"mode": "filtered", "width": 4})
    assert key != store.key(identity, "decode", args, {"mode": "greedy", "width": 3})
    assert key != store.key(identity, "decode", (jnp.zeros((2, 4)),),
                            {"mode": "greedy", "width": 4})
    assert key != store.key(identity, "decode", (jnp.zeros((2, 3), jnp.int32),),
                            {"mode": "greedy", "width": 4})
    # a JAX setting that changes the trace (float32 exactness runs use this one)
    precision = jax.config.jax_default_matmul_precision
    try:
        jax.config.update("jax_default_matmul_precision", "highest")
        assert key != store.key(identity, "decode", args, {"mode": "greedy", "width": 4})
    finally:
        jax.config.update("jax_default_matmul_precision", precision)
    assert key == store.key(identity, "decode", args, {"mode": "greedy", "width": 4})


def test_a_damaged_entry_is_dropped_and_compiled_again(store, traces, caplog):
    target, drafter = build(kind="dspine")
    first, _ = run(SpeculativeEngine(target, drafter, eos_token_ids=[0]), REQUESTS[:1])
    damaged = sorted(store.folder.glob(f"*{SUFFIX}"))[0]
    damaged.write_bytes(damaged.read_bytes()[:1000])
    traces.clear()
    with caplog.at_level(logging.WARNING, logger="dspine_jax.program_store"):
        again, steps = run(SpeculativeEngine(target, drafter, eos_token_ids=[0]),
                           REQUESTS[:1])
    assert again == first
    assert len(traces) == 1 and steps.loaded == steps.compiles - 1
    assert f"dropping the stored program {damaged.name}" in caplog.text
    assert damaged.stat().st_size > 1000          # stored again, whole


def test_the_store_drops_its_least_recently_used_entries_past_its_size(tmp_path):
    program = jax.jit(lambda x: x * 2 + 1).lower(jnp.zeros(4)).compile()
    store = ProgramStore(tmp_path, max_bytes=1 << 30)
    assert store.save("a", program)
    size = (tmp_path / f"a{SUFFIX}").stat().st_size
    store.max_bytes = 2 * size
    assert store.save("b", program)
    for age, name in ((200, "a"), (100, "b")):     # "a" written first (mtimes are coarse)
        os.utime(tmp_path / f"{name}{SUFFIX}", (time.time() - age,) * 2)
    assert store.load("a") is not None      # used: "b" is now the least recent
    assert store.save("c", program)
    assert sorted(p.stem for p in tmp_path.glob(f"*{SUFFIX}")) == ["a", "c"]
    assert store.load("b") is None
    assert list(tmp_path.glob("*.tmp")) == []
    loaded = store.load("c")
    assert jnp.array_equal(loaded(jnp.arange(4.0)), jnp.arange(4.0) * 2 + 1)


STORED_RUN = """
import json, sys
from dspine_jax import compile_cache
compile_cache.use_compile_cache(sys.argv[1])
from dspine_jax.engine import SpeculativeEngine
from tests.test_engine import build
from tests.test_program_store import run
target, drafter = build(kind="dspine")
tokens, steps = run(SpeculativeEngine(target, drafter, eos_token_ids=[0]))
print(json.dumps({"tokens": tokens, "loaded": steps.loaded, "compiles": steps.compiles}))
"""


def test_a_program_stored_after_a_compile_cache_hit_runs_in_the_next_process(tmp_path):
    """JAX's persistent cache holds the programs but the store does not (its entries were
    dropped, or the code changed): an executable read from JAX's cache is not stored (one
    serialized again failed in the next process: a fused function not found), so the
    next process runs what the store holds and reads the rest from JAX's cache, with the
    first run's tokens."""
    import json
    import shutil
    import subprocess
    import sys

    def process() -> dict:
        done = subprocess.run([sys.executable, "-c", STORED_RUN, str(tmp_path)],
                              capture_output=True, text=True, timeout=600,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = process()
    assert first["loaded"] == 0
    shutil.rmtree(tmp_path / "programs")
    second = process()                    # JAX's cache has them, the store does not
    assert second["loaded"] == 0 and second["tokens"] == first["tokens"]
    kept = len(list((tmp_path / "programs").glob(f"*{SUFFIX}")))
    assert kept < second["compiles"]      # those read from JAX's cache were not kept
    third = process()
    assert third["loaded"] == kept and third["tokens"] == first["tokens"]
