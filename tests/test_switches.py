"""The switches that change a decoding program (`pallas_kernels.switches`) are read from
the environment once, when a decoder is built, and every program is traced under its
decoder's record: changing a switch between two calls compiles a new program (the
kernels' jit caches are keyed by the record), and never reuses one traced under the old
value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspine_jax.generate import AutoregressiveGenerator
from dspine_jax.runtime import slot_steps
from dspine_jax.runtime.fixed_batch import FixedBatch
from pallas_kernels import top_k as long_rows
from pallas_kernels.dspine_proposal import dspine_proposal, vocab_top_k
from pallas_kernels.dspine_proposal import reference as proposal_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention import gpu as rpa_gpu
from pallas_kernels.switches import Switches, current
from tests.test_engine import build


def test_the_environment_is_read_once_and_checked():
    env = {"DSPINE_TOP_K_SPLIT": "0", "DSPINE_CHAIN_WALK": "steps", "DSPINE_RPA_COMBINE":
           "kernel", "DSPINE_WARP_THRESHOLD": "pallas", "DSPINE_WARP_UNFILTERED": "0",
           "DSPINE_TOP_K_GROUPED": "0", "DSPINE_RPA_FUSED_WRITE": "0",
           "DSPINE_TOP_K_SELECT": "sort", "DSPINE_RPA_PACKED": "0", "DSPINE_RPA_ROPE": "1"}
    assert Switches.from_environment(env) == Switches(
        warp_unfiltered=False, warp_threshold="pallas", chain_walk="steps", top_k_grouped=False,
        top_k_split=False, rpa_fused_write=False, rpa_combine="kernel", top_k_select="sort",
        rpa_packed=False, rpa_rope=True)
    assert Switches.from_environment({}) == Switches() == current()
    with pytest.raises(ValueError, match="DSPINE_TOP_K_SPLIT must be 0 or 1"):
        Switches.from_environment({"DSPINE_TOP_K_SPLIT": "no"})
    with pytest.raises(ValueError, match="DSPINE_CHAIN_WALK"):
        Switches.from_environment({"DSPINE_CHAIN_WALK": "sideways"})
    with pytest.raises(ValueError, match="DSPINE_WARP_THRESHOLD"):
        Switches.from_environment({"DSPINE_WARP_THRESHOLD": "1"})
    with pytest.raises(ValueError, match="DSPINE_TOP_K_SELECT"):
        Switches.from_environment({"DSPINE_TOP_K_SELECT": "heap"})


def test_a_decoder_keeps_the_switches_it_was_built_with(monkeypatch):
    target, _ = build()
    monkeypatch.setenv("DSPINE_WARP_UNFILTERED", "0")
    first = AutoregressiveGenerator(target)
    monkeypatch.setenv("DSPINE_WARP_UNFILTERED", "1")     # too late for `first`
    second = AutoregressiveGenerator(target)
    assert not first.switches.warp_unfiltered and second.switches.warp_unfiltered
    FixedBatch(first, [[3, 4]], max_new_tokens=2, temperature=1.0)
    FixedBatch(second, [[3, 4]], max_new_tokens=2, temperature=1.0)
    # the sampling mode is part of each decode program's key: filtered for one only
    def modes(decoder):
        return {key[2] for name, key in slot_steps.compiled(decoder)._executables
                if name == "decode"}
    assert modes(first) == {"filtered"} and modes(second) == {"unfiltered"}


def spy(monkeypatch, module, name, field, result):
    """Replace module.name by a function that records the switch `field` it is traced
    under and returns `result(*args)`."""
    seen = []
    jax.clear_caches()        # programs traced by earlier tests would hide the first trace

    def record(*args, **kwargs):
        seen.append(getattr(current(), field))
        return result(*args, **kwargs)

    monkeypatch.setattr(module, name, record)
    return seen


@pytest.mark.parametrize("field", ["top_k_grouped", "top_k_split"])
def test_top_k_switches_retrace_the_vocabulary_top_k(monkeypatch, field):
    reader = "groups_rows" if field == "top_k_grouped" else "splits_rows"
    seen = spy(monkeypatch, long_rows, reader, field, lambda: False)
    hidden, weight = jnp.ones((2, 8)), jnp.arange(40.0).reshape(5, 8)
    for value in (True, False, True):
        with Switches(**{field: value}).active():
            jax.block_until_ready(vocab_top_k(hidden, weight, 3, implementation="xla"))
    # traced once per value (the third call reuses the first program), never stale
    assert seen == [True, False]


def test_chain_walk_switch_retraces_the_proposal(monkeypatch):
    seen = spy(monkeypatch, proposal_reference, "walk_at_once", "chain_walk",
               lambda: current().chain_walk == "all")
    target, drafter = build(kind="dspine", block=4)
    weights = drafter.proposer("sparse", "xla").transition_weights()
    embedding = target.output_embedding()
    b, s, d = 1, 3, embedding.shape[1]
    hidden = jnp.asarray(np.random.default_rng(0).normal(size=(b, s, d)), jnp.float32)
    for mode in ("steps", "all"):
        with Switches(chain_walk=mode).active():
            dspine_proposal(hidden, hidden, jnp.zeros((b,), jnp.int32), embedding, weights,
                            jnp.ones((b,)), jnp.ones((b,)), jnp.zeros((b,), jnp.int32),
                            jax.random.key(0), num_candidates=4, eps=1e-6, greedy=False,
                            implementation="xla")
    assert seen == ["steps", "all"]


@pytest.mark.parametrize("field, values", [("rpa_fused_write", (True, False)),
                                           ("rpa_combine", ("xla", "unrolled", "kernel"))])
def test_attention_switches_retrace_the_kernel(monkeypatch, field, values):
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

    seen = spy(monkeypatch, rpa_gpu, "ragged_paged_attention_gpu", field,
               lambda *a, interpret=False, rope=None, **k: ragged_paged_attention_reference(
                   *a, **k))
    q = jnp.ones((1, 2, 2, 64))
    kv = jnp.ones((1, 2, 1, 64))
    pages = jnp.zeros((4, 16, 1, 64))
    args = (q, kv, kv, pages, pages, jnp.zeros((1, 1), jnp.int32), jnp.array([2]),
            jnp.array([2]))
    for value in values:
        with Switches(**{field: value}).active():
            jax.block_until_ready(ragged_paged_attention(*args, implementation="pallas_gpu"))
    assert seen == list(values)


def test_packed_switches_choose_what_the_kernel_is_given(monkeypatch):
    """rpa_packed and rpa_rope on: the pallas backend hands the op the packed q/k/v and
    its rotation as they are; rpa_rope off: rotated by XLA first; rpa_packed off: split
    into q, new_k and new_v first. The attention is the same every way."""
    import pallas_kernels
    from dspine_jax.attention.backend import PallasBackend
    from dspine_jax.attention.metadata import AttentionMetadata
    from dspine_jax.rope import rope_table

    calls = []
    op = pallas_kernels.ragged_paged_attention

    def record(q, new_k, *args, rope=None, **kwargs):
        calls.append((new_k is None, rope is not None))
        return op(q, new_k, *args, rope=rope, **kwargs)

    monkeypatch.setattr(pallas_kernels, "ragged_paged_attention", record)
    rng = np.random.default_rng(0)
    b, t, n, k, h = 2, 3, 4, 2, 64
    qkv = jnp.asarray(rng.standard_normal((b, t, n + 2 * k, h)), jnp.float32)
    pages = (jnp.zeros((6, 16, k, h)), jnp.zeros((6, 16, k, h)))
    metadata = AttentionMetadata.paged(jnp.array([5, 0]), jnp.array([[0, 1], [2, 3]]), t)
    rotation = rope_table(metadata.positions, 10000.0 ** (-np.arange(0, h, 2) / h))
    outs = []
    for packed, rope in ((True, True), (True, False), (False, True)):
        with Switches(rpa_packed=packed, rpa_rope=rope).active():
            out, _ = PallasBackend("pallas_gpu", interpret=True).packed(
                qkv, metadata, pages, rotation=rotation, num_kv_heads=k)
            outs.append(np.asarray(out))
    assert calls == [(True, True), (True, False), (False, False)]
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], rtol=1e-5, atol=1e-5)


def test_warp_threshold_searches_with_the_kernel_by_default():
    """The default is the Pallas search at every row count (less device time than a sort
    from one row up on an H100); each value names one implementation."""
    from dspine_jax.sampling import gpu_threshold_implementation

    assert Switches().warp_threshold == "pallas"
    assert gpu_threshold_implementation() == "pallas_gpu"
    for choice, implementation in (("sort", "sort"), ("search", "search"),
                                   ("pallas", "pallas_gpu")):
        with Switches(warp_threshold=choice).active():
            assert gpu_threshold_implementation() == implementation
    with pytest.raises(ValueError, match="warp_threshold"):
        Switches(warp_threshold="auto")
