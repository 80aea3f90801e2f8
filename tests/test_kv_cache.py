"""Cached decoding equals a full recompute; ragged batches equal rows alone; rollback."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspine_jax.config import TargetConfig
from dspine_jax.generate import AutoregressiveGenerator
from dspine_jax.kv_cache import PagedKVCache
from dspine_jax.target import TargetModel
from dspine_jax.runtime import slot_steps
from dspine_jax.runtime.offline import generate_tokens

CONFIG = TargetConfig(family="qwen3", vocab_size=97, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=128, rope_theta=1e4)


@pytest.fixture(scope="module")
def model():
    m = TargetModel(CONFIG, rngs=nnx.Rngs(3))
    # Larger weights than the 0.02 init so the argmax is decisive and mistakes show.
    for _, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):
        var[...] = var[...] * 10 if var[...].ndim == 2 else var[...]
    return m


def forward(model):
    """The model's forward under jit (eager NNX runs op by op: minutes instead of seconds)."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(tokens, cache=None):
        return nnx.merge(graphdef, params)(tokens, cache)
    return lambda tokens, cache=None: run(jnp.asarray(tokens), cache)


def full_logits(model, tokens, pad_to: int = 48):
    """Uncached logits; right padding changes nothing before it (causal), so pad to one
    shape and compile once."""
    t = tokens.shape[1]
    padded = np.pad(tokens, ((0, 0), (0, pad_to - t)))
    return np.asarray(forward_cache(model)(padded).logits)[:, :t]


_FORWARDS = {}


def forward_cache(model):
    if id(model) not in _FORWARDS:
        _FORWARDS[id(model)] = forward(model)
    return _FORWARDS[id(model)]


def test_decode_with_cache_equals_full_recompute(model):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 97, size=(2, 30))
    ref = full_logits(model, tokens)
    fwd = forward_cache(model)
    cache = PagedKVCache.contiguous(CONFIG, 2, 64)
    out = fwd(tokens[:, :10], cache)  # prefill 10
    got = [np.asarray(out.logits)]
    cache = out.cache
    for t in range(10, 22):  # single-token steps
        out = fwd(tokens[:, t:t + 1], cache)
        got.append(np.asarray(out.logits))
        cache = out.cache
    out = fwd(tokens[:, 22:30], cache)  # a multi-token (verify) step
    got.append(np.asarray(out.logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), ref, rtol=1e-5, atol=1e-5)
    assert out.cache.lengths.tolist() == [30, 30]


def test_ragged_rows_at_their_own_positions(model):
    """Row b of a padded batch at cache length l_b equals that row alone."""
    rng = np.random.default_rng(1)
    lengths = [5, 11, 8]
    prompts = [rng.integers(0, 97, size=n) for n in lengths]
    padded = np.zeros((3, 12), np.int64)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    fwd = forward_cache(model)
    out = fwd(padded, PagedKVCache.contiguous(CONFIG, 3, 32))
    cache = out.cache.replace(lengths=jnp.asarray(lengths))
    step = rng.integers(0, 97, size=(3, 3))
    out2 = fwd(step, cache)
    for i, p in enumerate(prompts):
        alone = full_logits(model, np.concatenate([p, step[i]])[None])
        np.testing.assert_allclose(np.asarray(out.logits[i, :len(p)]), alone[0, :len(p)],
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(out2.logits[i]), alone[0, len(p):],
                                   rtol=1e-5, atol=1e-5)


def test_rollback_leaves_no_stale_entries(model):
    """Write 6 tokens, roll back 4, write 4 others: same as never writing the first ones."""
    rng = np.random.default_rng(2)
    prefix, rejected, accepted = (rng.integers(0, 97, size=(1, n)) for n in (7, 6, 4))
    fwd = forward_cache(model)
    cache = fwd(prefix, PagedKVCache.contiguous(CONFIG, 1, 32)).cache
    after = fwd(rejected, cache).cache
    rolled = after.rollback(after.lengths - 4)
    assert rolled.lengths.tolist() == [9]
    got = fwd(accepted, rolled).logits
    ref = full_logits(model, np.concatenate([prefix, rejected[:, :2], accepted], axis=1))
    np.testing.assert_allclose(np.asarray(got)[0], ref[0, -4:], rtol=1e-5, atol=1e-5)


def test_batched_generation_equals_each_row_alone(model):
    gen = AutoregressiveGenerator(model, eos_token_ids=[5])
    rng = np.random.default_rng(4)
    prompts = [rng.integers(6, 97, size=n).tolist() for n in (3, 17, 9, 1)]
    batch = generate_tokens(gen, prompts, max_new_tokens=20)
    for prompt, together in zip(prompts, batch.generations):
        alone = generate_tokens(gen, [prompt], max_new_tokens=20).generations[0]
        assert together.tokens == alone.tokens
        assert together.finish_reason == alone.finish_reason


def test_greedy_generation_equals_argmax_recompute(model):
    """Every generated token is the argmax of a full, uncached forward of what came before."""
    gen = AutoregressiveGenerator(model, eos_token_ids=[])
    prompt = [1, 2, 3, 4]
    out = generate_tokens(gen, [prompt], max_new_tokens=25).generations[0]
    assert len(out.tokens) == 25 and out.finish_reason == "length"
    seq = list(prompt)
    for token in out.tokens:
        assert token == int(np.argmax(full_logits(model, np.asarray([seq]))[0, -1]))
        seq.append(token)


def test_eos_stops_a_row_and_ignore_eos_does_not(model):
    gen = AutoregressiveGenerator(model, eos_token_ids=[])
    free = generate_tokens(gen, [[1, 2, 3]], max_new_tokens=12).generations[0].tokens
    eos = free[4]
    stopper = AutoregressiveGenerator(model, eos_token_ids=[eos])
    stopped = generate_tokens(stopper, [[1, 2, 3]], max_new_tokens=12).generations[0]
    first = free.index(eos)
    assert stopped.tokens == free[:first + 1] and stopped.finish_reason == "stop"
    ignored = generate_tokens(stopper, [[1, 2, 3]], max_new_tokens=12,
                              ignore_eos=True).generations[0]
    assert ignored.tokens == free and ignored.finish_reason == "length"


def test_decoding_does_not_recompile(model):
    """Requests in one shape bucket reuse the compiled prefill and decode: one prefill
    (it traces the general sampler) and one decode per sampling mode (greedy; sampled
    without top-p/top-k; filtered)."""
    gen = AutoregressiveGenerator(model, eos_token_ids=[])
    compiled = slot_steps.compiled(gen)
    generate_tokens(gen, [[1, 2, 3]], max_new_tokens=20)
    generate_tokens(gen, [[4, 5, 6, 7, 8]], max_new_tokens=25)
    assert compiled.compiles == 2
    generate_tokens(gen, [[4, 5, 6, 7, 8]], max_new_tokens=25, temperature=0.7, seed=3)
    generate_tokens(gen, [[9, 9]], max_new_tokens=17, temperature=1.0, seed=5)
    assert compiled.compiles == 3
    generate_tokens(gen, [[9, 9]], max_new_tokens=17, temperature=1.0, top_p=0.5, seed=4)
    generate_tokens(gen, [[1, 2, 3]], max_new_tokens=20, temperature=0.9, top_k=5, seed=6)
    assert compiled.compiles == 4


def test_sampled_generation_is_seeded(model):
    gen = AutoregressiveGenerator(model, eos_token_ids=[])
    a = generate_tokens(gen, [[1, 2]], max_new_tokens=16, temperature=1.0, seed=7).generations[0]
    b = generate_tokens(gen, [[1, 2]], max_new_tokens=16, temperature=1.0, seed=7).generations[0]
    c = generate_tokens(gen, [[1, 2]], max_new_tokens=16, temperature=1.0, seed=8).generations[0]
    assert a.tokens == b.tokens and a.tokens != c.tokens
